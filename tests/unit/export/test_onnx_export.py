"""ONNX export: real exports of tiny models, parity against PyTorch in onnxruntime, and every refusal.

A torch.onnx (dynamo) export costs seconds of CPU even for a tiny model, so the bundles several tests read are
exported once per module (the fixtures below; a test that changes a bundle works on its own copy)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fedclinic.cli import main
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.export.onnx_export import ExportReport, ParityError, check_parity, export_onnx
from fedclinic.models.feature_classification import package_feature_model

from tests.helpers.text_models import tiny_package


@dataclass
class Exported:
    """A package saved in ``folder`` and exported once into ``bundle`` (read-only for the tests)."""

    package: object
    folder: Path
    bundle: Path
    report: ExportReport
    log: list[str]


def _export_once(root: Path, package, **options) -> Exported:
    package.save(root / "pkg")
    log: list[str] = []
    report = export_onnx(root / "pkg", root / "bundle", log=log.append, **options)
    return Exported(package, root / "pkg", root / "bundle", report, log)


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Exported:
    """A two-layer BERT text classifier exported with --int8 (two layers: the rewrites must handle every layer,
    and the first-token one only the last), on 40 held-out texts: the untrained model's two logits are within
    1e-3 of each other on seeded random token ids, where int8 rounding flips one of 12 on an AVX2-only CPU."""
    from fedclinic.models import package_from_config

    from tests.helpers.text_models import LABELS, tiny_tokenizer_json

    config = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 32, "max_position_embeddings": 64}
    pkg = package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=tiny_tokenizer_json(),
                              config=config, max_length=16, seed=5)
    return _export_once(tmp_path_factory.mktemp("encoder"), pkg, int8=True, texts=_encoder_texts())


def _encoder_texts() -> list[str]:
    from tests.helpers.text_models import make_examples

    return [row["text"] for row in make_examples(40, seed=7)]


@pytest.fixture(scope="module")
def lstm(tmp_path_factory) -> Exported:
    """The text BiLSTM exported with --int8 (the first RNN export of this process: see the FedNER test)."""
    return _export_once(tmp_path_factory.mktemp("lstm"), tiny_package("lstm", seed=3), int8=True)


@pytest.fixture(scope="module")
def crf_tagger(tmp_path_factory) -> Exported:
    """A BERT + CRF NER model exported with --int8 on held-out texts."""
    from tests.helpers.ner_models import make_examples, package

    texts = [e.text for e in make_examples(20, seed=6)]
    return _export_once(tmp_path_factory.mktemp("crf"), package("transformer-crf", scheme="BIOES", seed=4),
                        int8=True, texts=texts)


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> Exported:
    return _export_once(tmp_path_factory.mktemp("features"), package_feature_model(num_features=5, labels=["a", "b"]))


@pytest.mark.parametrize("architecture", ["transformer", "lstm", "logreg"])
def test_text_model_exports_with_dynamic_axes_and_matches_pytorch(tmp_path, request, architecture):
    import onnxruntime as ort

    from fedclinic.models import build_model

    if architecture == "logreg":
        exported = _export_once(tmp_path, tiny_package(architecture, seed=3), int8=True)
    else:
        exported = request.getfixturevalue({"transformer": "encoder", "lstm": "lstm"}[architecture])
    pkg, report, out = exported.package, exported.report, exported.bundle
    assert report.fp32.max_abs_diff <= 1e-4 and report.fp32.inputs == (40 if architecture == "transformer" else 12)
    assert report.int8 is not None and report.int8.top1_agreement >= 0.95
    saved = json.loads((out / "export_report.json").read_text())
    assert saved["fp32"]["max_abs_diff"] == report.fp32.max_abs_diff
    assert {"model.onnx", "model.int8.onnx", "tokenizer.json", "fedclinic_model.json"} <= set(report.files)
    # a batch and length never seen at export time runs, and padding changes nothing for the real tokens
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    loaded = build_model(pkg)
    ids = np.array([[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 0, 0, 0, 0]], np.int64)
    ids[1, 3:] = loaded.pad_id
    mask = (np.arange(7)[None, :] < np.array([[7], [3]])).astype(np.int64)
    padded = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
    alone = session.run(["logits"], {"input_ids": ids[1:, :3], "attention_mask": mask[1:, :3]})[0]
    np.testing.assert_allclose(padded[1], alone[0], atol=1e-5)
    if architecture == "transformer":  # BERT: one fused Attention op per layer; int8: ONNX Attention, int8 Q/K/V
        import onnx

        graphs = {name: onnx.load(str(out / name)) for name in ("model.onnx", "model.int8.onnx")}
        ops = {name: {(n.domain, n.op_type) for n in g.graph.node} for name, g in graphs.items()}
        layers = loaded.module.config.num_hidden_layers
        assert report.fused_attention_layers == layers == saved["fused_attention_layers"]
        assert ("com.microsoft", "Attention") in ops["model.onnx"] and ("", "Softmax") not in ops["model.onnx"]
        assert ("com.microsoft", "SkipLayerNormalization") not in ops["model.onnx"]  # slower than Add + LayerNorm
        int8_nodes = graphs["model.int8.onnx"].graph.node
        assert sum(n.op_type == "Attention" and n.domain == "" for n in int8_nodes) == layers
        assert {op for _, op in ops["model.int8.onnx"]}.isdisjoint({"QAttention", "MatMul"})  # every MatMul is int8
        # per layer: Q, K, V, attention output and the two feed-forward projections; then pooler and classifier
        assert sum(n.op_type == "MatMulInteger" for n in int8_nodes) == 6 * layers + 2
        assert sum(n.name.endswith("_first_token_slice") for n in int8_nodes) == 1  # the pooler reads token 0


def test_an_encoder_whose_attention_does_not_fuse_keeps_the_plain_graph(tmp_path, monkeypatch):
    """When onnxruntime's patterns match fewer layers than the model has, the unfused graph is kept, and it
    still matches PyTorch."""
    import onnx

    from fedclinic.export import encoder_fusion as onnx_encoder_fusion

    monkeypatch.setattr(onnx_encoder_fusion, "_scale_by_division", lambda model: None)  # the matcher then fails
    tiny_package("transformer", seed=3).save(tmp_path / "pkg")
    messages: list[str] = []
    report = export_onnx(tmp_path / "pkg", tmp_path / "out", int8=True, log=messages.append)
    assert report.fused_attention_layers == 0 and report.fp32.max_abs_diff <= 1e-4
    assert any("attention fused in 0 of 1 layers: keeping the unfused graph" in m for m in messages)
    assert "Attention" not in {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node}


def test_int8_rewrites_of_the_encoder_keep_its_function(tmp_path, encoder):
    """The rewrites made before int8 quantization (fedclinic.export.encoder_int8), on a padded batch: unpacking each
    fused attention changes the fp32 logits by float rounding only, and quantized it gives the logits of the fused
    op quantized whole (QAttention); computing the last layer at the first token only changes the fp32 logits by
    float rounding only too."""
    import onnx
    import onnxruntime as ort

    from fedclinic.export import encoder_int8 as onnx_encoder_int8
    from fedclinic.export.quantize import _quantize_dynamic
    from fedclinic.models import build_model

    pkg = encoder.package
    fused = onnx.load(str(encoder.bundle / "model.onnx"))
    fused.graph.ClearField("value_info")
    unpacked = onnx.ModelProto()
    unpacked.CopyFrom(fused)
    assert onnx_encoder_int8.unpack_attention(unpacked) == 2
    onnx.checker.check_model(unpacked)
    assert [o.version for o in unpacked.opset_import if o.domain == ""] == [onnx_encoder_int8.UNPACKED_ATTENTION_OPSET]
    assert not any(n.domain == "com.microsoft" and n.op_type == "Attention" for n in unpacked.graph.node)
    first_token = onnx.ModelProto()
    first_token.CopyFrom(unpacked)
    assert onnx_encoder_int8.keep_first_token(first_token) is True
    onnx.checker.check_model(first_token)

    pad = build_model(pkg).pad_id
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4, 1, 9, 6])
    ids = rng.integers(4, 30, size=(5, 9)).astype(np.int64)
    mask = (np.arange(9)[None, :] < lengths[:, None]).astype(np.int64)
    ids[mask == 0] = pad

    def logits(model_or_path):
        source = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
        session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
        return session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]

    np.testing.assert_allclose(logits(unpacked), logits(fused), atol=1e-5)
    np.testing.assert_allclose(logits(first_token), logits(fused), atol=1e-5)
    _quantize_dynamic(unpacked, tmp_path / "unpacked.onnx", ["MatMul"])
    _quantize_dynamic(fused, tmp_path / "qattention.onnx", ["MatMul", "Attention"])
    assert "QAttention" in {n.op_type for n in onnx.load(str(tmp_path / "qattention.onnx")).graph.node}
    np.testing.assert_allclose(logits(tmp_path / "unpacked.onnx"), logits(tmp_path / "qattention.onnx"), atol=1e-5)


def test_the_first_token_rewrite_leaves_a_graph_that_reads_every_token(encoder):
    """A graph that also outputs the last layer's every position is not rewritten."""
    import onnx

    from fedclinic.export import encoder_int8 as onnx_encoder_int8

    model = onnx.load(str(encoder.bundle / "model.onnx"))
    assert onnx_encoder_int8.unpack_attention(model) == 2
    pooled = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] != "input_ids"
                  and "embeddings" not in n.input[0])
    model.graph.output.append(onnx.helper.make_tensor_value_info(pooled.input[0], onnx.TensorProto.FLOAT, None))
    before = model.SerializeToString()
    assert onnx_encoder_int8.keep_first_token(model) is False
    assert model.SerializeToString() == before


def test_an_onnxruntime_without_the_onnx_attention_kernel_gets_qattention(tmp_path, monkeypatch, encoder):
    """When the installed onnxruntime cannot load the unpacked graph, --int8 quantizes the fused attention whole,
    and that graph passes export's int8 parity check. The int8 step of ``export_onnx --int8`` (quantize_int8, then
    check_parity on the same inputs) is run on the exported fp32 graph; the other --int8 tests run it inside
    export_onnx."""
    import onnx
    import onnxruntime as ort
    import torch

    from fedclinic.export import quantize as export
    from fedclinic.export.onnx_export import INT8_MIN_AGREEMENT, INT8_TOLERANCE, parity_inputs
    from fedclinic.models import build_model

    loads = export._loads_in_onnxruntime
    probed: list[bool] = []

    def old_onnxruntime(path):
        probed.append(loads(path))  # the real probe loads the unpacked graph on this onnxruntime
        return False

    monkeypatch.setattr(export, "_loads_in_onnxruntime", old_onnxruntime)
    assert export.quantize_int8(encoder.bundle / "model.onnx", tmp_path / "model.int8.onnx") == []  # no rewrite
    loaded = build_model(encoder.package)
    session = ort.InferenceSession(str(tmp_path / "model.int8.onnx"), providers=["CPUExecutionProvider"])

    def torch_logits(ids, mask):
        with torch.no_grad():
            return loaded.logits(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    int8 = check_parity(lambda ids, mask: session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0],
                        torch_logits, parity_inputs(loaded, texts=_encoder_texts()), tolerance=INT8_TOLERANCE,
                        min_agreement=INT8_MIN_AGREEMENT)
    assert probed == [True] and int8.top1_agreement >= 0.95
    ops = {n.op_type for n in onnx.load(str(tmp_path / "model.int8.onnx")).graph.node}
    assert "QAttention" in ops and "Attention" not in ops


def test_the_onnxruntime_probe_refuses_an_op_without_a_kernel(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from fedclinic.export.quantize import _loads_in_onnxruntime

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    for op, domain, path in (("Relu", "", tmp_path / "ok.onnx"), ("NoSuchOp", "com.example", tmp_path / "bad.onnx")):
        graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], domain=domain)], "g", [x],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                         helper.make_opsetid("com.example", 1)]),
                  str(path))
    assert _loads_in_onnxruntime(tmp_path / "ok.onnx") is True
    assert _loads_in_onnxruntime(tmp_path / "bad.onnx") is False


def test_feature_model_exports(features):
    report = features.report
    assert report.family == "feature-classification" and report.fp32.max_abs_diff <= 1e-4 and report.int8 is None


def test_parity_check_fails_above_the_tolerance_and_leaves_no_model(tmp_path):
    tiny_package("transformer").save(tmp_path / "pkg")  # a logreg's graph equals PyTorch's to the last bit
    with pytest.raises(ParityError, match=r"max \|ONNX - PyTorch\| = .* > tolerance 1e-15"):
        export_onnx(tmp_path / "pkg", tmp_path / "out", tolerance=1e-15)
    assert not list((tmp_path / "out").glob("model*"))
    ones = lambda *xs: np.ones((2, 3))  # noqa: E731
    flipped = lambda *xs: np.array([[0.0, 1, 0], [1, 0, 0]])  # noqa: E731
    with pytest.raises(ParityError, match="top-1 agreement 0.0%"):
        check_parity(flipped, lambda *xs: np.array([[1.0, 0, 0], [0, 1, 0]]), [(np.zeros(1),)], tolerance=5,
                     min_agreement=0.9)
    with pytest.raises(ParityError, match="shape"):
        check_parity(ones, lambda *xs: np.ones((2, 4)), [(np.zeros(1),)], tolerance=1)


def test_refusals_say_what_to_do(tmp_path, features):
    with pytest.raises(ConfigError, match="is not a folder"):
        export_onnx(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IntegrityError, match="holds no model.safetensors"):
        export_onnx(tmp_path / "empty", tmp_path / "out")
    shutil.copytree(features.bundle, tmp_path / "out")  # a bundle an earlier export wrote
    before = (tmp_path / "out" / "model.onnx").read_bytes()
    with pytest.raises(ConfigError, match="exists; choose another OUT_DIR or pass --overwrite"):
        export_onnx(features.folder, tmp_path / "out")
    assert (tmp_path / "out" / "model.onnx").read_bytes() == before  # nothing already stored is lost


def test_cli_export_with_held_out_texts(tmp_path, capsys):
    tiny_package("logreg").save(tmp_path / "pkg")
    texts = tmp_path / "heldout.jsonl"
    texts.write_text('{"text": "fever and cough"}\n{"text": "rash after amoxicillin"}\n')
    assert main(["export", "onnx", str(tmp_path / "pkg"), str(tmp_path / "out"), "--texts", str(texts),
                 "--allow-unsigned"]) == 0
    assert "fp32 parity: max |ONNX - PyTorch|" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "export_report.json").read_text())["fp32"]["inputs"] == 2
    texts.write_text("not json\n")
    assert main(["export", "onnx", str(tmp_path / "pkg"), str(tmp_path / "o2"), "--texts", str(texts)]) == 2
    assert "heldout.jsonl:1: expected a JSON object with a 'text' field" in capsys.readouterr().err


@pytest.mark.parametrize("config", [
    {"embedding_dim": 8, "hidden_size": 12, "num_layers": 2, "bidirectional": True, "dropout": 0.3},
    {"embedding_dim": 8, "hidden_size": 12, "num_layers": 2, "bidirectional": False},
])
def test_lstm_export_path_equals_the_packed_path(config):
    """The LSTM's unpacked forward (what the exporter traces) against the packed one, with ragged lengths."""
    import torch

    from fedclinic.models import build_model, package_from_config

    from tests.helpers.text_models import LABELS, tiny_tokenizer_json

    pkg = package_from_config(architecture="lstm", labels=LABELS, tokenizer_json=tiny_tokenizer_json(),
                              config=config, max_length=16, seed=1)
    module = build_model(pkg).module.eval()
    ids = torch.randint(1, 20, (4, 9), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(9)[None] < torch.tensor([9, 3, 1, 6])[:, None]).long()
    with torch.no_grad():
        packed = module(ids, mask)
        unpacked = module.classifier(module._features_unpacked(ids, mask))
    np.testing.assert_allclose(unpacked.numpy(), packed.numpy(), atol=1e-6)


def test_served_bundle_predicts_like_the_pytorch_model(tmp_path, encoder):
    import torch

    from fedclinic.training import trainer as training
    from fedclinic.data.text import Example
    from fedclinic.models import build_model
    from fedclinic.serving.bundle import ClassifierBundle

    pkg = encoder.package
    shutil.copytree(encoder.bundle, tmp_path / "bundle")
    (tmp_path / "bundle" / "model.int8.onnx").unlink()  # as exported without --int8
    bundle = ClassifierBundle(tmp_path / "bundle", threads=1)
    texts = ["fever cough night", "rash itch skin", "fever"]
    got = bundle.predict(texts)
    loaded = build_model(pkg)
    data = training.encode([Example(t, (loaded.labels[0],)) for t in texts], loaded)
    with torch.no_grad():
        want = torch.softmax(loaded.logits(data.input_ids, data.attention_mask), -1).numpy()
    for row, p in zip(got, want):
        assert row["label"] == loaded.labels[int(p.argmax())]
        np.testing.assert_allclose([row["scores"][lab] for lab in loaded.labels], p, atol=1e-5)
    from fedclinic.errors import DatasetError

    with pytest.raises(DatasetError, match="text 1 is empty"):
        bundle.predict(["ok", "  "])
    with pytest.raises(ConfigError, match="no model.int8.onnx.*--int8"):
        ClassifierBundle(tmp_path / "bundle", int8=True)
    # a graph the installed onnxruntime has no kernel for (as an int8 graph of opset 24 on an older onnxruntime)
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["logits"], domain="com.example")], "g", [x],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                                     helper.make_opsetid("com.example", 1)]),
              str(tmp_path / "bundle" / "model.int8.onnx"))
    with pytest.raises(ConfigError, match=r"onnxruntime .* cannot load .*model.int8.onnx.*constraints.txt"):
        ClassifierBundle(tmp_path / "bundle", int8=True)
    with pytest.raises(ConfigError, match="takes texts"):
        bundle.predict_features(np.zeros((1, 3)))
    (tmp_path / "bundle" / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        ClassifierBundle(tmp_path / "bundle")


def test_a_failed_re_export_leaves_the_existing_bundle_untouched(tmp_path, encoder):
    shutil.copytree(encoder.bundle, tmp_path / "out")  # an --int8 bundle an earlier export wrote
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    tiny_package("transformer", seed=9).save(tmp_path / "pkg2")  # a different model
    with pytest.raises(ParityError, match="tolerance 1e-12"):  # fp32 passes, int8 cannot meet this
        export_onnx(tmp_path / "pkg2", tmp_path / "out", int8=True, int8_tolerance=1e-12, overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]
    tiny_package("logreg", seed=9).save(tmp_path / "pkg3")  # another model, cheaper to export
    export_onnx(tmp_path / "pkg3", tmp_path / "out", overwrite=True)  # fp32 only: the old int8 must go
    assert not (tmp_path / "out" / "model.int8.onnx").exists()
    assert (tmp_path / "out" / "model.onnx").read_bytes() != before["model.onnx"]


@pytest.mark.parametrize("architecture", ["transformer", "transformer-crf"])
def test_ner_model_exports_and_decodes_like_pytorch(tmp_path, request, architecture):
    """Emissions within 1e-4; with a CRF, the graph's own Viterbi path equals PyTorch's on every input."""
    import onnxruntime as ort
    import torch

    from fedclinic.models import build_model

    from tests.helpers.ner_models import make_examples, package

    if architecture == "transformer-crf":
        exported = request.getfixturevalue("crf_tagger")  # package(architecture, scheme="BIOES", seed=4)
    else:
        texts = [e.text for e in make_examples(20, seed=6)]
        exported = _export_once(tmp_path, package(architecture, scheme="BIOES", seed=4), int8=True, texts=texts)
    pkg, report, out = exported.package, exported.report, exported.bundle
    assert report.fp32.max_abs_diff <= 1e-4
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    if architecture == "transformer":
        import onnx

        assert outputs == ["logits"] and report.fp32.path_agreement is None
        int8_nodes = onnx.load(str(out / "model.int8.onnx")).graph.node
        assert any(n.op_type == "Attention" and n.domain == "" for n in int8_nodes)  # unpacked, and
        assert not any(n.name.endswith("_first_token_slice") for n in int8_nodes)  # every token's tags are read
        return
    assert outputs == ["logits", "tags"] and report.fp32.path_agreement == 1.0
    assert report.int8 is not None and report.int8.path_agreement is not None
    # random emissions stress the decoder harder than an untrained model's near-uniform ones: paths still equal
    loaded = build_model(pkg)
    with torch.no_grad():
        for p in (loaded.module.crf.transitions, loaded.module.crf.start_transitions, loaded.module.crf.end_transitions):
            p.normal_(0, 2.0)
    from fedclinic.export.crf import append_viterbi
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "l", 9]),
                               helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "l"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "l", 9])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    crf = loaded.module.crf
    append_viterbi(model, emissions="logits", mask="attention_mask", transitions=crf.transitions.detach().numpy(),
                   start=crf.start_transitions.detach().numpy(), end=crf.end_transitions.detach().numpy())
    onnx.checker.check_model(model, full_check=True)
    viterbi = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(0)
    for batch, width in ((1, 2), (4, 7), (16, 30)):
        em = torch.randn(batch, width, 9, generator=gen) * 3
        lengths = torch.randint(1, width + 1, (batch,), generator=gen)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        got = viterbi.run(["tags"], {"x": em.numpy(), "attention_mask": mask.numpy()})[0]
        np.testing.assert_array_equal(got, crf.viterbi(em, mask).numpy())


def test_a_wrong_crf_graph_fails_the_path_check(tmp_path, crf_tagger):
    """The path check is real: decoding with other transitions than the model's is caught."""
    import onnx
    from onnx import numpy_helper

    import onnxruntime as ort

    from fedclinic.export.onnx_export import check_paths, torch_paths
    from fedclinic.models import build_model

    from tests.helpers.ner_models import make_examples

    pkg = crf_tagger.package
    model = onnx.load(str(crf_tagger.bundle / "model.onnx"))
    for init in model.graph.initializer:
        if init.name == "crf_viterbi_transitions":
            size = numpy_helper.to_array(init).shape[0]
            init.CopyFrom(numpy_helper.from_array(-10 * np.eye(size, dtype=np.float32), init.name))
    onnx.save(model, str(tmp_path / "wrong.onnx"))
    loaded = build_model(pkg)
    from fedclinic.export.onnx_export import parity_inputs

    batches = parity_inputs(loaded, texts=[e.text for e in make_examples(16, seed=8)])
    with pytest.raises(ParityError, match="CRF path equals PyTorch's Viterbi path on"):
        check_paths(ort.InferenceSession(str(tmp_path / "wrong.onnx"), providers=["CPUExecutionProvider"]),
                    torch_paths(loaded, batches), batches, min_agreement=1.0)


def test_bundle_card_carries_the_package_card_and_the_export_parity(tmp_path):
    """The bundle's model card: the package's card plus an export section equal to export_report.json."""
    from fedclinic.spec.model_card import build_card, write_card
    from fedclinic.transport.package import ModelPackage
    from fedclinic.proto import control_pb2, task_pb2

    pkg = tiny_package("logreg", seed=2)
    folder = pkg.save(tmp_path / "pkg")
    status = control_pb2.TaskStatus(task_id="t-1", spec=task_pb2.TaskSpec(name="cc", dataset="notes"), rounds=[
        control_pb2.RoundSummary(round=1, state=control_pb2.ROUND_STATE_CLOSED, model_hash=pkg.manifest().model_hash,
                                 metrics={"train_loss": 0.5},
                                 reports=[control_pb2.SiteReport(site_id="site-a", num_samples=3)])])
    write_card(folder, build_card(pkg.meta, model_hash=pkg.manifest().model_hash, status=status))
    assert ModelPackage.load(folder).manifest().model_hash == pkg.manifest().model_hash  # the card is no package file
    report = export_onnx(folder, tmp_path / "out", int8=True)
    out = tmp_path / "out"
    saved = json.loads((out / "export_report.json").read_text())
    card = json.loads((out / "model_card.json").read_text())
    assert card["task"]["id"] == "t-1" and card["rounds_completed"] == 1 and card["sites"] == ["site-a"]
    ex = card["export"]
    assert ex["opset"] == saved["opset"] == 18 and ex["inputs"] == ["input_ids", "attention_mask"]
    for precision in ("fp32", "int8"):
        assert ex[precision] == {k: v for k, v in saved[precision].items() if v is not None}
    assert ex["fp32"]["max_abs_diff"] == report.fp32.max_abs_diff
    assert {"model_card.json", "MODEL_CARD.md"} <= set(saved["files"]) and (out / "MODEL_CARD.md").is_file()
    assert "## ONNX export" in (out / "MODEL_CARD.md").read_text()
    # a package made locally (no card) still gets one, from fedclinic_model.json; no int8 section without --int8
    tiny_package("logreg").save(tmp_path / "local")
    export_onnx(tmp_path / "local", tmp_path / "out2")
    local = json.loads((tmp_path / "out2" / "model_card.json").read_text())
    assert local["task"] is None and local["labels"] == pkg.meta["labels"] and "int8" not in local["export"]
    assert local["export"]["fp32"]["max_abs_diff"] == \
        json.loads((tmp_path / "out2" / "export_report.json").read_text())["fp32"]["max_abs_diff"]


def test_fedner_model_exports_and_decodes_like_pytorch(tmp_path, lstm):
    """cnn-bilstm-crf: the BiLSTM is traced through its unpacked forward; emissions within 1e-4 on ragged padded
    batches, the graph's CRF path equals PyTorch's Viterbi path, and the served bundle finds the same entities.
    The ``lstm`` fixture exports an RNN earlier in this process: torch's memoised LSTM kernel must not pin this
    export's sequence axis (the inputs below have lengths the export never saw)."""
    import onnxruntime as ort
    import torch

    from fedclinic.export.onnx_export import check_paths, parity_inputs, torch_paths
    from fedclinic.models import build_model
    from fedclinic.serving.bundle import ClassifierBundle

    from tests.helpers.fedner_models import package as fedner_package
    from tests.helpers.ner_models import make_examples

    pkg = fedner_package(seed=4, scheme="BIOES")
    pkg.save(tmp_path / "pkg")
    texts = [e.text for e in make_examples(20, seed=6)]
    report = export_onnx(tmp_path / "pkg", tmp_path / "out", texts=texts)
    assert report.architecture == "cnn-bilstm-crf"
    assert report.fp32.max_abs_diff <= 1e-4 and report.fp32.path_agreement == 1.0
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["logits", "tags"]
    loaded = build_model(pkg)
    # export's own checks on its default inputs too: seeded random batches of 1, 3, 8 rows, padded
    batches = parity_inputs(loaded)

    def torch_emissions(ids, mask):
        with torch.no_grad():
            return loaded.emissions(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    default = check_parity(lambda ids, mask: session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0],
                           torch_emissions, batches, tolerance=1e-4)
    assert default.max_abs_diff <= 1e-4
    assert check_paths(session, torch_paths(loaded, batches), batches, min_agreement=1.0) == 1.0
    # a batch and length never seen at export time; padding changes nothing for the real tokens
    ids = np.array([[2, 5, 6, 7, 8, 9, 10, 11, 3], [2, 12, 13, 3, 0, 0, 0, 0, 0]], np.int64)
    mask = (ids != 0).astype(np.int64)
    emissions, tags = session.run(["logits", "tags"], {"input_ids": ids, "attention_mask": mask})
    alone = session.run(["logits"], {"input_ids": ids[1:, :4], "attention_mask": mask[1:, :4]})[0]
    np.testing.assert_allclose(emissions[1, :4], alone[0], atol=1e-5)
    with torch.no_grad():
        want = loaded.emissions(torch.from_numpy(ids), torch.from_numpy(mask))
        np.testing.assert_allclose(emissions, want.numpy(), atol=1e-4)
        np.testing.assert_array_equal(tags * mask, loaded.decode(torch.from_numpy(ids), torch.from_numpy(mask)).numpy())
    bundle = ClassifierBundle(tmp_path / "out", threads=1)
    assert [row["entities"] for row in bundle.predict(texts[:6])] == loaded.predict_entities(texts[:6])


def test_a_mislabelled_question_answering_package_is_refused_before_any_export(tmp_path):
    """Question-answering models export (tests/unit/export/test_causal_lm.py); a package that only claims the
    family is refused with the reason, and nothing is written."""
    from fedclinic.transport.package import META_FILE, ModelPackage

    pkg = tiny_package("logreg")
    meta = json.loads(pkg.files[META_FILE])
    meta["family"] = "question-answering"
    ModelPackage(pkg.tensors, {**pkg.files, META_FILE: json.dumps(meta).encode()}).save(tmp_path / "pkg")
    with pytest.raises(ConfigError, match="unknown architecture 'logreg' for family 'question-answering'"):
        export_onnx(tmp_path / "pkg", tmp_path / "out")
    assert not (tmp_path / "out").exists()
