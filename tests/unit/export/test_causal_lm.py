"""ONNX export of question-answering (causal LM) models: a decoder graph with past key/values, checked by generation.

Real exports of tiny GPT-2 and Llama models built from config, run by the numpy generation loop on
onnxruntime (fedclinic.serving.generate) and compared with PyTorch's greedy generation (CausalLMModel.generate).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from fedclinic.errors import ConfigError, DatasetError
from fedclinic.export.onnx_export import QA_FP32_TOLERANCE, ParityError, export_onnx
from fedclinic.models import build_model, module_tensors
from fedclinic.models.causal_lm import stored_names
from fedclinic.transport.package import ModelPackage

from tests.helpers.qa_models import TINY, TINY_LLAMA, package, toy_examples, train

QUESTIONS = ["what treats headache", "what treats diabetes", "what is the drug for a patient with reflux"]
CONFIGS = {"gpt2": TINY, "llama": TINY_LLAMA}


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def trained_package(config, seed: int = 0) -> ModelPackage:
    """A tiny causal LM trained to answer the toy questions (answers end with EOS)."""
    start = package(config, seed=seed)
    model = build_model(start)
    train(model, toy_examples())
    return ModelPackage(module_tensors(model.module, stored_names(model.module)), start.files)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (package, bundle folder, report): trained tiny GPT-2 and Llama, exported with --int8."""
    out = {}
    for name, config in CONFIGS.items():
        root = tmp_path_factory.mktemp(f"qa-{name}")
        pkg = trained_package(config, seed=1)
        pkg.save(root / "pkg")
        out[name] = (pkg, root / "bundle", export_onnx(root / "pkg", root / "bundle", int8=True, texts=QUESTIONS))
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_onnx_greedy_answers_are_pytorch_answers_token_for_token(exported, name):
    import onnxruntime as ort

    from fedclinic.serving.generate import OnnxCausalLM, OnnxQAModel

    pkg, bundle, report = exported[name]
    fp32 = report.fp32
    assert report.family == "question-answering" and report.opset == 18
    assert fp32.max_abs_diff <= 1e-4 and fp32.token_agreement == 1.0 and fp32.inputs == 3
    assert fp32.tolerance == QA_FP32_TOLERANCE == 1e-3  # the default for LMs (see fedclinic.export.onnx_export)
    assert fp32.generated_tokens > fp32.inputs  # the answers have tokens, not only their EOS
    loaded = build_model(pkg)
    qa = OnnxQAModel.load(bundle)
    questions = QUESTIONS + ["what treats infection", "drug for hypertension"]
    contexts = ["", "patient needs drug", "", "", "the patient with hypertension needs a drug"]
    # the trained model answers; ONNX and PyTorch give the same text, in batches of 1, 2 and all at once
    want = loaded.generate(questions, contexts)
    assert want[:2] == ["drug aspirin", "drug metformin"]
    for batch_size in (1, 2, 16):
        assert qa.generate(questions, contexts, batch_size=batch_size) == want
    # token ids, in batches of 3
    lm = OnnxCausalLM(ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"]),
                      eos_id=loaded.eos_id, pad_id=loaded.pad_id, max_positions=loaded.max_positions)
    prompts = loaded.prompt_ids(questions, contexts)
    assert lm.generate_ids(prompts, max_new_tokens=5, batch_size=3) == loaded.generate_ids(prompts, max_new_tokens=5,
                                                                                            batch_size=3)
    # with an end marker no token has (-1), every row runs on to the position limit: long generations, 1-token
    # steps over a long past, past the trained answers' EOS (the trained answers above end at different steps:
    # rows fed padding after their EOS). The same graph: no second export of another model for this.
    endless = dataclasses.replace(loaded, meta={**loaded.meta, "eos_token_id": -1})
    lm_u = OnnxCausalLM(lm.session, eos_id=endless.eos_id, pad_id=endless.pad_id, max_positions=endless.max_positions)
    long = lm_u.generate_ids(prompts, max_new_tokens=100, batch_size=5)
    assert long == endless.generate_ids(prompts, max_new_tokens=100, batch_size=5)
    width = max(len(p) for p in prompts)
    assert min(len(r) for r in long) == max(len(r) for r in long) == endless.max_positions - width


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_graph_interface_and_bundle_files(exported, name):
    import onnxruntime as ort

    pkg, bundle, report = exported[name]
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    outputs = {o.name: o.shape for o in session.get_outputs()}
    layers = 2
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert set(inputs) == {"input_ids", "attention_mask", "position_ids",
                           *(f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value"))}
    assert set(outputs) == {"logits", *(f"present.{i}.{k}" for i in range(layers) for k in ("key", "value"))}
    assert inputs["input_ids"] == ["batch", "seq"] and isinstance(inputs["attention_mask"][1], str)
    key = inputs["past_key_values.0.key"]
    assert key[0] == "batch" and key[2] == "past" and all(isinstance(d, int) for d in (key[1], key[3]))
    assert outputs["logits"][:2] == ["batch", "seq"]
    meta = json.loads((bundle / "fedclinic_model.json").read_text())
    assert meta == {**pkg.meta, "max_positions": 64}
    assert {"model.onnx", "model.int8.onnx", "tokenizer.json", "config.json", "fedclinic_model.json",
            "model_card.json", "MODEL_CARD.md"} <= set(report.files) <= {p.name for p in bundle.iterdir()}
    saved = json.loads((bundle / "export_report.json").read_text())
    assert saved["fp32"]["token_agreement"] == 1.0 and saved["fp32"]["max_abs_diff"] == report.fp32.max_abs_diff
    card = json.loads((bundle / "model_card.json").read_text())
    assert card["export"]["inputs"][:3] == ["input_ids", "attention_mask", "position_ids"]
    assert card["export"]["fp32"]["token_agreement"] == 1.0
    assert any("token-for-token identical" in n for n in card["notes"])
    assert "token-for-token identical" in (bundle / "MODEL_CARD.md").read_text()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_int8_reports_token_agreement_against_pytorch(exported, name):
    from fedclinic.serving.generate import OnnxQAModel

    pkg, bundle, report = exported[name]
    int8 = report.int8
    assert int8 is not None and int8.tolerance is None  # reported, not checked, unless --int8-tolerance is given
    assert 0.0 <= int8.token_agreement <= 1.0 and int8.generated_tokens == report.fp32.generated_tokens
    assert 0 < int8.max_abs_diff < 1.0  # quantized: different, but close
    loaded = build_model(pkg)
    answers = OnnxQAModel.load(bundle, int8=True).generate(QUESTIONS)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    # the reported agreement is the one these answers show against PyTorch's greedy tokens
    from fedclinic.export.causal_lm import token_agreement

    prompts = loaded.prompt_ids(QUESTIONS)
    qa8 = OnnxQAModel.load(bundle, int8=True)
    got = qa8.lm.generate_ids(prompts, max_new_tokens=loaded.max_new_tokens, batch_size=8)
    assert token_agreement(got, loaded.generate_ids(prompts, batch_size=8))[0] == int8.token_agreement


def test_token_agreement_counts_the_common_prefix_and_the_end():
    from fedclinic.export.causal_lm import token_agreement

    assert token_agreement([[1, 2, 3]], [[1, 2, 3]]) == (1.0, 4)          # 3 tokens + the end
    assert token_agreement([[1, 9, 3]], [[1, 2, 3]]) == (0.25, 4)         # nothing counts after a divergence
    assert token_agreement([[1, 2]], [[1, 2, 3]]) == (0.5, 4)             # an early EOS diverges at the 3rd token
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 3]]) == (0.75, 4)      # a missing EOS diverges at the end
    assert token_agreement([[], [5]], [[], [6]]) == (1 / 3, 3)


def test_a_wrong_graph_or_different_tokens_fail_the_check(exported, tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from fedclinic.export.causal_lm import check_decoder
    from fedclinic.serving.generate import OnnxCausalLM

    pkg, bundle, _ = exported["gpt2"]
    loaded = build_model(pkg)
    prompts = loaded.prompt_ids(QUESTIONS)
    want = loaded.generate_ids(prompts, batch_size=8)

    def decoder(path):
        return OnnxCausalLM(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), eos_id=loaded.eos_id,
                            pad_id=loaded.pad_id, max_positions=loaded.max_positions)

    good = decoder(bundle / "model.onnx")
    result, tokens = check_decoder(good, loaded, prompts, want, tolerance=1e-4, identical=True)
    assert tokens == want and result.token_agreement == 1.0
    # PyTorch's tokens differ from the graph's (one token changed): the generation check fails
    changed = [list(r) for r in want]
    changed[1][-1] += 1
    with pytest.raises(ParityError, match="greedy answer to prompt 1 differs from PyTorch's at generated token"):
        check_decoder(good, loaded, prompts, changed, tolerance=1e-4, identical=True)
    # a graph whose weights are wrong (the tied embedding / output layer disturbed): the logits check fails
    graph = onnx.load(str(bundle / "model.onnx"))
    vocab = loaded.module.config.vocab_size
    init = next(t for t in graph.graph.initializer if len(t.dims) == 2 and t.dims[0] == vocab)
    weights = numpy_helper.to_array(init).copy()
    weights += np.random.default_rng(0).normal(0, 0.05, weights.shape).astype(np.float32)
    init.CopyFrom(numpy_helper.from_array(weights, init.name))
    onnx.save(graph, str(tmp_path / "wrong.onnx"))
    with pytest.raises(ParityError, match=r"max \|ONNX - PyTorch\| = .* > tolerance 0.0001 on the first-step logits"):
        check_decoder(decoder(tmp_path / "wrong.onnx"), loaded, prompts, want, tolerance=1e-4, identical=True)


def test_a_failed_check_leaves_no_model_behind(tmp_path):
    """A failed check raises and leaves nothing. An explicit int8 tolerance is checked too: the CLI test below
    exports with --int8-tolerance, and its report carries that tolerance as the one check_decoder applied (which
    raises above any tolerance it is given: test_a_wrong_graph_or_different_tokens_fail_the_check)."""
    package(TINY, seed=2).save(tmp_path / "pkg")  # untrained: the check fails either way
    with pytest.raises(ParityError, match=r"> tolerance 1e-15"):
        export_onnx(tmp_path / "pkg", tmp_path / "out", int8=True, tolerance=1e-15)
    assert not list((tmp_path / "out").iterdir())
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_cli_export_with_questions_and_contexts(tmp_path, capsys):
    from fedclinic.cli import main

    package(TINY, seed=2).save(tmp_path / "pkg")
    texts = tmp_path / "questions.jsonl"
    texts.write_text('{"text": "what treats headache"}\n{"text": "what drug", "context": "patient with reflux"}\n')
    assert main(["export", "onnx", str(tmp_path / "pkg"), str(tmp_path / "out"), "--texts", str(texts),
                 "--allow-unsigned", "--int8", "--int8-tolerance", "1.5"]) == 0
    printed = capsys.readouterr().out
    assert "fp32 parity: max |ONNX - PyTorch|" in printed
    assert "greedy answers to 2 questions identical to PyTorch's" in printed
    assert "(tolerance 1.5)" in printed  # the int8 figures were checked against the given tolerance
    saved = json.loads((tmp_path / "out" / "export_report.json").read_text())
    assert saved["fp32"]["inputs"] == 2 and saved["int8"]["tolerance"] == 1.5
    texts.write_text('{"text": "what drug", "context": 3}\n')
    assert main(["export", "onnx", str(tmp_path / "pkg"), str(tmp_path / "o2"), "--texts", str(texts)]) == 2
    assert "questions.jsonl:1: 'context' must be a string" in capsys.readouterr().err


def test_the_serving_loop_needs_no_torch(exported):
    """onnx_generate and the serving bundle import and answer with torch and transformers unimportable."""
    pkg, bundle, _ = exported["gpt2"]
    want = build_model(pkg).generate(QUESTIONS, ["", "patient needs drug", ""])
    script = (
        "import json, sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from fedclinic.serving.generate import OnnxQAModel\n"
        "from fedclinic.serving.bundle import ClassifierBundle\n"
        "q = json.loads(sys.argv[2])\n"
        "b = ClassifierBundle(sys.argv[1], threads=1)\n"
        "out = b.predict(q, contexts=['', 'patient needs drug', ''])\n"
        "print(json.dumps([o['answer'] for o in out]))\n"
        "assert not any(m == 'torch' or m.startswith(('torch.', 'transformers')) for m in sys.modules\n"
        "               if sys.modules[m] is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(bundle), json.dumps(QUESTIONS)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want


def test_served_bundle_refuses_bad_questions(exported):
    from fedclinic.serving.bundle import ClassifierBundle

    _, bundle, _ = exported["gpt2"]
    b = ClassifierBundle(bundle, threads=1)
    assert b.family == "question-answering" and b.labels == []
    assert [p["answer"] for p in b.predict(["what treats headache"])] == ["drug aspirin"]
    with pytest.raises(DatasetError, match="question 1 is empty"):
        b.predict(["what treats headache", "  "])
    with pytest.raises(DatasetError, match=r"question 0 is too long: its prompt is \d+ tokens and the model takes at "
                                           r"most 24 \(max_length 32\); shorten the question or its context"):
        b.predict(["what treats headache " * 10])
    with pytest.raises(DatasetError, match="question 0 is too long"):  # a context counts too
        b.predict(["what treats headache"], contexts=["the patient with reflux needs a drug " * 5])
    with pytest.raises(ConfigError, match="1 contexts for 2 questions"):
        b.predict(["what treats headache", "what treats reflux"], contexts=[""])
    with pytest.raises(ConfigError, match="generates answers"):
        b.logits(["what treats headache"])


def test_sampling_is_seeded_and_draws_from_the_nucleus(exported):
    from fedclinic.serving.generate import OnnxQAModel, next_token

    _, bundle, _ = exported["llama"]
    qa = OnnxQAModel.load(bundle)
    state = np.random.get_state()[1].copy()
    kw = dict(do_sample=True, temperature=5.0, seed=3)
    first = qa.generate(QUESTIONS * 2, **kw)
    assert qa.generate(QUESTIONS * 2, **kw) == first            # same seed, same answers
    assert any(qa.generate(QUESTIONS * 2, do_sample=True, temperature=5.0, seed=s) != first for s in (4, 5, 6))
    assert np.array_equal(np.random.get_state()[1], state)       # the global RNG is left alone
    with pytest.raises(ConfigError, match="top_p must be in"):
        qa.generate(QUESTIONS, do_sample=True, top_p=0)
    # the nucleus: p = [0.6, 0.3, 0.1]; top_p 0.5 keeps token 0 only, 0.8 keeps 0 and 1 in ratio 2:1
    logits = np.log(np.array([[0.6, 0.3, 0.1]] * 3000))
    rng = np.random.default_rng(0)
    assert set(next_token(logits, rng, 1.0, 0.5)) == {0}
    draws = next_token(logits, rng, 1.0, 0.8)
    assert set(draws) == {0, 1} and abs(np.mean(draws == 0) - 2 / 3) < 0.03
    full = next_token(logits, rng, 1.0, 1.0)
    assert abs(np.mean(full == 2) - 0.1) < 0.02
    assert list(next_token(np.array([[0.0, 3.0, 3.0]]), None)) == [1]  # greedy: the first maximum, as torch
