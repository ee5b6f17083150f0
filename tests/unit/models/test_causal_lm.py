"""The question-answering family: a causal LM trained on answer tokens only, generation, metrics, packaging."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.training import trainer as training
from fedclinic.data.qa import QAExample
from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models import build_model
from fedclinic.models.causal_lm import (
    IGNORE,
    PLAIN_TEMPLATE,
    chat_prompt,
    fill_prompt,
    package_qa_from_config,
    package_qa_pretrained,
    prompt_budget,
)
from fedclinic.transport.package import META_FILE, WEIGHTS_FILE, ModelPackage
from fedclinic.federation.simulate import simulate
from fedclinic.models import package_for_task
from fedclinic.spec.task import Task

from tests.helpers.qa_models import TINY, TINY_LLAMA, package, toy_examples, train

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def learned(torch_one_thread):
    """A tiny GPT-2 trained to answer the toy questions (about 1 s on one core)."""
    model = build_model(package())
    train(model, toy_examples())
    return model


# ------------------------------------------------------------------------------------------------------------
# encoding and loss


def test_labels_cover_the_answer_and_eos_only():
    model = build_model(package())
    examples = [QAExample("what treats headache", "drug aspirin"),
                QAExample("what is the drug for a patient with reflux", "omeprazole", context="patient needs drug")]
    data = training.encode(examples, model)
    tok = model.tokenizer
    for i, ex in enumerate(examples):
        prompt = model.prompt(ex.question, ex.context)
        assert prompt == (PLAIN_TEMPLATE.replace("{question}", ex.question) if not ex.context else
                          f"Context: {ex.context}\nQuestion: {ex.question}\nAnswer:")
        p_ids = tok.encode(prompt, add_special_tokens=False).ids
        a_ids = tok.encode(" " + ex.answer, add_special_tokens=False).ids + [model.eos_id]
        n = len(p_ids) + len(a_ids)
        assert data.prompts[i] == p_ids
        assert data.input_ids[i, :n].tolist() == p_ids + a_ids
        assert data.labels[i, :len(p_ids)].tolist() == [IGNORE] * len(p_ids)  # the prompt is not scored
        assert data.labels[i, len(p_ids):n].tolist() == a_ids                 # the answer and its EOS are
        assert (data.labels[i, n:] == IGNORE).all() and (data.attention_mask[i, n:] == 0).all()
        assert (data.input_ids[i, n:] == model.pad_id).all()
    assert data.references == ["drug aspirin", "omeprazole"]


def test_loss_is_on_answer_tokens_only(learned):
    import torch
    import torch.nn.functional as F

    model = learned  # trained on answers only: its answer loss is small, its loss on the prompts is not
    data = training.encode(toy_examples()[:4] + [QAExample("what is the drug for a patient with diabetes",
                                                           "metformin")], model)
    (ids, mask), labels = data.batch(torch.arange(len(data)), torch.device("cpu"))
    # 1. equal to cross-entropy over the positions that predict an answer token, from the full logits
    with torch.no_grad():
        logits = model.logits(ids, mask)[:, :-1]
        gold = labels[:, 1:]
        on = gold != IGNORE
        expected = F.cross_entropy(logits[on], gold[on])
        loss = model.training_loss((ids, mask), labels)
        with_prompt = F.cross_entropy(logits[mask[:, 1:].bool()], ids[:, 1:][mask[:, 1:].bool()])
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert float(with_prompt) > float(loss) + 0.5  # scoring the prompt too would give another number
    # 2. no gradient reaches the output at a position whose next token is part of the prompt (or padding)
    captured = {}

    def keep(_module, _inputs, output):
        output.last_hidden_state.retain_grad()
        captured["h"] = output.last_hidden_state

    handle = model.module.base_model.register_forward_hook(keep)
    try:
        model.training_loss((ids, mask), labels).backward()
    finally:
        handle.remove()
        model.module.zero_grad(set_to_none=True)
    grad = captured["h"].grad[:, :-1].norm(dim=-1)
    assert (grad[~on] == 0).all()
    assert (grad[on] > 0).all()


def test_long_prompts_are_cut_from_the_left_and_leave_room_for_the_answer():
    model = build_model(package(max_length=16))
    long_q = " ".join(["what is the drug for a patient with"] * 4) + " reflux"
    data = training.encode([QAExample(long_q, "drug omeprazole"), QAExample("what treats reflux", "drug omeprazole")],
                           model, max_length=16)
    assert prompt_budget(16) == 12
    full = model.tokenizer.encode(model.prompt(long_q), add_special_tokens=False).ids
    assert data.prompts[0] == full[-12:]  # the end of the prompt ("reflux answer :") survives
    assert data.labels[0].tolist()[12:16] == data.input_ids[0].tolist()[12:16]  # 4 answer tokens: drug, omeprazole, eos
    assert int(data.attention_mask[0].sum()) == 12 + 3


def test_encode_rejects_other_examples():
    from fedclinic.data.text import Example

    model = build_model(package())
    with pytest.raises(DatasetError, match="read_qa"):
        training.encode([Example("text", ("a",))], model)
    with pytest.raises(DatasetError, match="empty"):
        training.encode([], model)


# ------------------------------------------------------------------------------------------------------------
# learning and generation


def test_tiny_model_learns_the_toy_answers(learned):
    examples = toy_examples()
    assert learned.generate([e.question for e in examples]) == [e.answer for e in examples]
    metrics = training.evaluate(learned, training.encode(examples, learned))
    assert metrics["exact_match"] == 1.0 and metrics["token_accuracy"] == 1.0
    assert metrics["rougeL"] == pytest.approx(1.0) and metrics["meteor"] > 0.9 and metrics["bleu"] == pytest.approx(1.0)
    assert metrics["loss"] < 0.05 and metrics["n"] == 6 and metrics["n_generated"] == 6
    untrained = training.evaluate(build_model(package()), training.encode(examples, learned))
    assert untrained["exact_match"] == 0.0 and untrained["loss"] > 1.0
    # generation during evaluation is capped (the rest still counts for loss and token accuracy)
    capped = learned.evaluate(training.encode(examples, learned), max_generate=2)
    assert capped["n_generated"] == 2 and capped["n"] == 6 and capped["loss"] == pytest.approx(metrics["loss"])


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(learned):
    import torch

    questions = [e.question for e in toy_examples()] * 3
    state = torch.random.get_rng_state()
    a = learned.generate(questions, do_sample=True, temperature=3.0, top_p=0.95, seed=7)
    b = learned.generate(questions, do_sample=True, temperature=3.0, top_p=0.95, seed=7)
    c = learned.generate(questions, do_sample=True, temperature=3.0, top_p=0.95, seed=8)
    assert torch.equal(state, torch.random.get_rng_state())
    assert a == b and a != c
    # a nucleus this small holds only the most likely token: sampling becomes greedy decoding
    assert learned.generate(questions, do_sample=True, top_p=1e-6, seed=1) == learned.generate(questions)
    with pytest.raises(ConfigError, match="temperature"):
        learned.generate(questions, do_sample=True, temperature=0)
    with pytest.raises(ConfigError, match="top_p"):
        learned.generate(questions, do_sample=True, top_p=1.5)


@pytest.mark.parametrize("config", [TINY, TINY_LLAMA], ids=["gpt2", "llama"])
def test_batched_left_padded_generation_equals_one_by_one(config):
    model = build_model(package(config, seed=5))
    questions = ["what treats headache", "what is the drug for a patient with reflux", "diabetes"]
    contexts = ["", "patient needs drug", ""]
    together = model.generate_ids(model.prompt_ids(questions, contexts), max_new_tokens=5, batch_size=8)
    alone = [model.generate_ids(model.prompt_ids([q], [c]), max_new_tokens=5)[0] for q, c in zip(questions, contexts)]
    assert together == alone
    assert all(len(row) <= 5 for row in together)
    assert all(model.eos_id not in row for row in together)


# ------------------------------------------------------------------------------------------------------------
# metrics (hand-computed)


def test_metrics_against_hand_computed_values():
    from fedclinic.evaluation.generation import bleu, exact_match, generation_scores, meteor, metric_tokens, rouge_l

    assert metric_tokens("Take Aspirin, 2x daily! 胃癌ok") == ["take", "aspirin", "2x", "daily", "胃", "癌", "ok"]
    # ROUGE-L: LCS(a c e f, a b c d e) = "a c e" = 3; P = 3/4, R = 3/5, F = 2PR/(P+R) = 2/3
    assert rouge_l(["a c e f"], ["a b c d e"]) == pytest.approx(2 / 3)
    # METEOR: hyp [patient, taking, aspirin] vs ref [the, patient, takes, aspirin, daily]; exact: patient, aspirin;
    # Porter stem: taking = takes = "take" -> m = 3, P = 1, R = 3/5, Fmean = PR / (0.9 P + 0.1 R) = 0.625,
    # one chunk -> penalty = 0.5 (1/3)^3 = 1/54, METEOR = 0.625 (1 - 1/54)
    assert meteor(["patient taking aspirin"], ["the patient takes aspirin daily"]) == pytest.approx(0.625 * 53 / 54)
    # no WordNet: synonyms that are neither exact nor stem matches do not count
    assert meteor(["medication"], ["drug"]) == 0.0
    # BLEU: the cat sat on the mat / the cat sat on a mat: p1..p4 = 5/6, 3/5, 2/4, 1/3, BP = 1 (equal lengths)
    assert bleu(["the cat sat on the mat"], ["the cat sat on a mat"]) == pytest.approx((5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)
    # short answers: only the orders that exist count (effective order): p1 = 3/4, p2 = 1/2 over 2 examples
    assert bleu(["drug aspirin", "drug x"], ["drug aspirin", "drug y"]) == pytest.approx((3 / 4 * 1 / 2) ** 0.5)
    assert exact_match(["Drug aspirin.", "drug"], ["drug Aspirin", "drug x"]) == 0.5
    assert generation_scores([""], ["drug"]) == {"rougeL": 0.0, "bleu": 0.0, "meteor": 0.0, "exact_match": 0.0}
    with pytest.raises(ConfigError):
        rouge_l(["a"], [])


# ------------------------------------------------------------------------------------------------------------
# prompt templates


def test_chat_template_is_rendered_once_into_the_package():
    pkg = package(chat_template=CHATML)
    prompt = pkg.meta["prompt"]
    assert prompt == {"source": "chat_template", "answer_prefix": "",
                      "template": "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
                      "context_template": "<|im_start|>user\nContext: {context}\nQuestion: {question}<|im_end|>\n"
                                          "<|im_start|>assistant\n"}
    model = build_model(pkg)
    # filled in one pass: text inside the question is never substituted again
    assert model.prompt("is {context} here?", "") == "<|im_start|>user\nis {context} here?<|im_end|>\n<|im_start|>assistant\n"
    assert fill_prompt(prompt, "q", "c").startswith("<|im_start|>user\nContext: c\nQuestion: q<|im_end|>")
    # plain is the default without a chat template, and can be forced with one
    assert package().meta["prompt"]["source"] == "plain"
    assert package(chat_template=CHATML, prompt="plain").meta["prompt"]["template"] == PLAIN_TEMPLATE


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_end|>{% endfor %}", "verbatim"),
    ("{{ raise_exception('no user turns') }}", "does not render"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "does not render"),  # the sandbox refuses it
    ("{% for m in messages %}", "does not render"),
])
def test_unusable_chat_templates_are_refused(template, message):
    with pytest.raises(ConfigError, match=message):
        chat_prompt(template)
    with pytest.raises(ConfigError, match="no chat template"):
        package(prompt="chat")


# ------------------------------------------------------------------------------------------------------------
# packaging


def test_package_meta_tied_head_and_rebuild():
    pkg = package()
    meta = pkg.meta
    assert (meta["family"], meta["architecture"], meta["labels"]) == ("question-answering", "causal-lm", [])
    assert (meta["eos_token"], meta["eos_token_id"], meta["pad_token_id"], meta["bos_token_id"]) == ("<eos>", 2, 0, None)
    assert meta["generation"] == {"max_new_tokens": 6, "eval_examples": 32}
    # the output layer is tied to the input embedding: stored (and sent) once
    assert "lm_head.weight" not in pkg.tensors and "transformer.wte.weight" in pkg.tensors
    model = build_model(pkg)
    assert model.module.lm_head.weight.data_ptr() == model.module.transformer.wte.weight.data_ptr()
    assert pkg.manifest().model_hash == package().manifest().model_hash  # seeded
    assert pkg.manifest().model_hash != package(seed=1).manifest().model_hash
    hf = json.loads(pkg.files["config.json"])
    assert (hf["eos_token_id"], hf["pad_token_id"], hf["architectures"]) == (2, 0, ["GPT2LMHeadModel"])


def test_package_errors():
    with pytest.raises(ConfigError, match="model_type 'bert' is not allowed.*gpt2, llama"):
        package({"model_type": "bert", "hidden_size": 32})
    with pytest.raises(ConfigError, match="exceeds what the model supports"):
        package(max_length=128)
    with pytest.raises(ConfigError, match="eos_token '<end>' is not in the tokenizer"):
        package(eos_token="<end>")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        package(max_new_tokens=0)
    with pytest.raises(ConfigError, match="prompt must be one of"):
        package(prompt="fancy")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    no_eos = Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).to_str()
    with pytest.raises(ConfigError, match="end-of-sequence token"):
        package_qa_from_config(tokenizer_json=no_eos, config=TINY)


def test_build_errors():
    pkg = package()
    missing = ModelPackage({k: v for k, v in pkg.tensors.items() if k != "transformer.wpe.weight"}, dict(pkg.files))
    with pytest.raises(IntegrityError, match="missing tensor.*transformer.wpe.weight"):
        build_model(missing)
    extra = ModelPackage({**pkg.tensors, "lm_head.weight": pkg.tensors["transformer.wte.weight"]}, dict(pkg.files))
    with pytest.raises(IntegrityError, match="unexpected tensor.*lm_head.weight"):
        build_model(extra)
    meta = pkg.meta
    for change, message in (({"architecture": "seq2seq"}, "unknown architecture 'seq2seq'.*causal-lm"),
                            ({"eos_token_id": 999}, "eos_token_id 999 is not a token id"),
                            ({"prompt": {"template": 1}}, "prompt must hold"),
                            ({"arch_config": {"model_type": "llama"}}, "says model_type 'llama'")):
        files = {**pkg.files, META_FILE: json.dumps({**meta, **change}).encode()}
        with pytest.raises((ConfigError, IntegrityError), match=message):
            build_model(ModelPackage(pkg.tensors, files))
    no_prompt = {k: v for k, v in meta.items() if k != "prompt"}
    with pytest.raises(IntegrityError, match="no 'prompt'"):
        build_model(ModelPackage(pkg.tensors, {**pkg.files, META_FILE: json.dumps(no_prompt).encode()}))


def _hf_folder(tmp_path, pkg: ModelPackage, *, strip_prefix: bool = False, extra: dict | None = None):
    """A Hugging Face-style folder: config.json, tokenizer.json, tokenizer_config.json, model.safetensors."""
    from safetensors.numpy import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes(pkg.files[name])
    tensors = {(k.removeprefix("transformer.") if strip_prefix else k): v for k, v in pkg.tensors.items()}
    save_file({**tensors, **(extra or {})}, str(folder / WEIGHTS_FILE))
    return folder


def test_pretrained_folder_round_trip_with_chat_template(tmp_path):
    pkg = package()
    wte = pkg.tensors["transformer.wte.weight"]
    # original GPT-2 files: no "transformer." prefix, a saved copy of the tied head, old mask buffers
    folder = _hf_folder(tmp_path, pkg, strip_prefix=True,
                        extra={"lm_head.weight": wte, "h.0.attn.bias": np.ones((1, 1, 4, 4), np.float32)})
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}, "chat_template": CHATML}))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.Model"}  # never followed: the class is built in
    (folder / "config.json").write_text(json.dumps(cfg))
    again = package_qa_pretrained(folder, max_length=32, max_new_tokens=6)
    assert sorted(again.tensors) == sorted(pkg.tensors)
    for name, arr in pkg.tensors.items():
        np.testing.assert_array_equal(again.tensors[name], arr)
    assert again.meta["prompt"]["source"] == "chat_template"
    assert again.files["tokenizer_config.json"] == (folder / "tokenizer_config.json").read_bytes()
    assert "auto_map" not in json.loads(again.files["config.json"])
    build_model(again)
    # chat_template.jinja (how recent transformers save it) wins; prompt="plain" ignores both
    (folder / "chat_template.jinja").write_text(CHATML.replace("<|im_start|>assistant", "<|im_start|>bot"))
    assert package_qa_pretrained(folder, max_length=32).meta["prompt"]["template"].endswith("<|im_start|>bot\n")
    assert package_qa_pretrained(folder, max_length=32, prompt="plain").meta["prompt"]["source"] == "plain"


def test_pretrained_folder_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        package_qa_pretrained(tmp_path / "nope")
    pkg = package()
    folder = _hf_folder(tmp_path, pkg)
    (folder / WEIGHTS_FILE).unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="pickle-based"):
        package_qa_pretrained(folder, max_length=32)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        package_qa_pretrained(folder, max_length=32)
    other = tmp_path / "other"
    other.mkdir()
    big = package({**TINY, "n_embd": 48})
    for name in ("config.json", "tokenizer.json"):
        (other / name).write_bytes(pkg.files[name])
    from safetensors.numpy import save_file

    save_file(big.tensors, str(other / WEIGHTS_FILE))
    with pytest.raises(IntegrityError, match="shape mismatch"):
        package_qa_pretrained(other, max_length=32)
    save_file({k: v for k, v in pkg.tensors.items() if "h.1." not in k}, str(other / WEIGHTS_FILE))
    with pytest.raises(IntegrityError, match="lack tensor"):
        package_qa_pretrained(other, max_length=32)


def test_task_for_the_family(tmp_path):
    folder = _hf_folder(tmp_path, package())
    task = Task(name="qa", dataset="qa", family="question-answering", architecture="causal-lm", model=str(folder),
                max_length=32)
    task.validate()
    assert list(task.to_spec().labels) == []
    pkg = package_for_task(task)
    assert pkg.meta["family"] == "question-answering" and sorted(pkg.tensors) == sorted(package().tensors)
    with pytest.raises(ConfigError, match="labels do not apply to question-answering"):
        Task(name="qa", dataset="qa", labels=["a", "b"], family="question-answering", architecture="causal-lm").validate()
    with pytest.raises(ConfigError, match="architecture 'transformer' is not one of"):
        Task(name="qa", dataset="qa", family="question-answering").validate()
    toml = tmp_path / "task.toml"
    toml.write_text('name = "qa"\ndataset = "qa"\nfamily = "question-answering"\narchitecture = "causal-lm"\n')
    assert Task.from_toml(toml).labels == []


# ------------------------------------------------------------------------------------------------------------
# simulation


def test_simulator_trains_the_family_two_sites_two_rounds():
    examples = toy_examples()
    sites = [examples[:3] * 2, examples[3:] * 2]
    result = simulate(package(), sites, rounds=2, eval_data=examples,
                      train=training.TrainConfig(local_epochs=15, batch_size=6, learning_rate=5e-3, max_length=32))
    assert len(result.rounds) == 2
    for r in result.rounds:
        assert {"loss", "token_accuracy", "rougeL", "bleu", "meteor", "exact_match", "n_generated"} <= set(r.metrics)
        assert all(0.0 <= r.metrics[k] <= 1.0 for k in ("token_accuracy", "rougeL", "bleu", "meteor", "exact_match"))
    assert result.rounds[-1].metrics["loss"] < result.initial_metrics["loss"]
    assert "lm_head.weight" not in result.package.tensors
    build_model(result.package)


def test_model_card_states_the_prompt():
    from fedclinic.spec.model_card import build_card, render_markdown

    pkg = package(chat_template=CHATML)
    card = build_card(pkg.meta, model_hash=pkg.manifest().model_hash)
    assert card["family"] == "question-answering" and card["labels"] == []
    assert card["prompt"] == pkg.meta["prompt"] and card["eos_token"] == "<eos>"
    assert card["generation"] == {"max_new_tokens": 6, "eval_examples": 32}
    md = render_markdown(card)
    assert "| Prompt | chat_template: `\"<\\|im_start\\|>user\\n{question}" in md
