"""ONNX export of a model package, with a parity check against PyTorch.

``fedclinic export onnx MODEL_DIR OUT_DIR [--int8]`` writes::

    OUT_DIR/model.onnx            fp32 graph, dynamic batch (and sequence) axes, opset 18
    OUT_DIR/model.int8.onnx       with --int8: dynamic int8 quantization of the weights (onnxruntime)
    OUT_DIR/tokenizer.json, fedclinic_model.json (and config.json)   what a server needs besides the graph;
                                  fedclinic_model.json is the label map (labels, and tags, in index order)
    OUT_DIR/export_report.json    parity figures, tolerances, inputs
    OUT_DIR/model_card.json, MODEL_CARD.md   the package's model card (fedclinic.model_card) plus an
                                  ``export`` section with the parity figures; made from fedclinic_model.json
                                  alone when the package has no card (a package made locally)

Inputs and outputs:

- text-classification: ``input_ids`` and ``attention_mask`` (int64 ``[batch, seq]``) -> ``logits``.
- feature-classification: ``features`` (float32 ``[batch, num_features]``) -> ``logits``.
- token-classification: ``input_ids``, ``attention_mask`` -> ``logits`` (per-token tag scores ``[batch, seq,
  tags]``); with a CRF also ``tags`` (int64 ``[batch, seq]``), the Viterbi path computed inside the graph
  (:mod:`fedclinic.onnx_crf`), which must equal PyTorch's path exactly on every parity input.

Parity: the held-out inputs (from ``--texts`` rows, or seeded random inputs of several batch sizes and
sequence lengths, with padding) go through PyTorch and onnxruntime. The maximum absolute difference of the
logits is printed, and the export fails above the tolerance (fp32: 1e-4). For int8 the figure is the
same maximum difference plus top-1 agreement with PyTorch, checked against ``int8_tolerance`` (default 1.0
in logit units; 2.0 for NER's per-token scores, whose maximum runs over every token) and 95 % agreement:
quantization changes values by design. Weights are quantized per channel, on the MatMuls only (on MiniLM
this kept every test prediction; per-tensor scales did not).

The exporter is torch's (``torch.onnx.export(..., dynamo=True)``); the graph is checked with ``onnx.checker``.
The LSTM architectures (text ``lstm``, NER ``cnn-bilstm-crf``) are traced through their unpacked forward
(``torch.compiler.is_exporting()``), which the parity check compares with the packed forward used in training.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.package import CARD_FILE, CARD_MARKDOWN_FILE

OPSET = 18
FP32_TOLERANCE = 1e-4
INT8_TOLERANCE = 1.0
#: per-token scores (NER): the maximum runs over every token of every input, thousands of values instead of one
#: row per input, so its tail is longer; token agreement and the CRF path agreement carry the decision
INT8_TOKEN_TOLERANCE = 2.0
INT8_MIN_AGREEMENT = 0.95
_SIDE_FILES = ("tokenizer.json", "fedclinic_model.json", "config.json", "tokenizer_config.json",
               "special_tokens_map.json")


@dataclass
class ParityResult:
    max_abs_diff: float
    top1_agreement: float     # share of argmax decisions (per row, or per token) that agree with PyTorch
    tolerance: float
    inputs: int
    path_agreement: float | None = None  # CRF: share of sequences whose ONNX Viterbi path equals PyTorch's


@dataclass
class ExportReport:
    family: str
    architecture: str
    opset: int
    fp32: ParityResult
    int8: ParityResult | None = None
    files: list[str] = field(default_factory=list)


class ParityError(IntegrityError):
    """The exported graph does not compute what the PyTorch model computes (within the stated tolerance)."""


def _wrapper(loaded) -> tuple[Any, list[str]]:
    """A module whose named tensor inputs call the family's forward, and the input names."""
    import torch

    if loaded.family == "feature-classification":
        class FeatureForward(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = loaded.module

            def forward(self, features):
                return loaded.logits(features)

        return FeatureForward().eval(), ["features"]

    if loaded.family == "token-classification":
        class TokenForward(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = loaded.module

            def forward(self, input_ids, attention_mask):
                return loaded.emissions(input_ids, attention_mask)

        return TokenForward().eval(), ["input_ids", "attention_mask"]

    class TextForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = loaded.module

        def forward(self, input_ids, attention_mask):
            return loaded.logits(input_ids, attention_mask)

    return TextForward().eval(), ["input_ids", "attention_mask"]


def parity_inputs(loaded, *, texts: Sequence[str] = (), seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    """Held-out inputs: ``texts`` tokenized with the model's tokenizer, or seeded random batches of sizes 1, 3
    and 8 (text: lengths up to the model's max_length, right-padded like the trainer pads)."""
    rng = np.random.default_rng(seed)
    if loaded.family == "feature-classification":
        return [(rng.normal(size=(b, loaded.num_features)).astype(np.float32),) for b in (1, 3, 8)]
    max_len = loaded.max_length
    batches = []
    if texts:
        from fedclinic.models.text_classification import encode_texts

        texts = list(texts)
        return [encode_texts(loaded.tokenizer, texts[start:start + 8], max_length=max_len, pad_id=loaded.pad_id)
                for start in range(0, len(texts), 8)]
    vocab = loaded.tokenizer.get_vocab_size(with_added_tokens=True)
    for b, width in ((1, 5), (3, max(2, max_len // 2)), (8, max_len)):
        lengths = rng.integers(1, width + 1, size=b)
        lengths[0] = width
        ids = np.full((b, width), loaded.pad_id, np.int64)
        mask = np.zeros((b, width), np.int64)
        for i, n in enumerate(lengths):
            ids[i, :n] = rng.integers(0, vocab, size=n)
            mask[i, :n] = 1
        batches.append((ids, mask))
    return batches


def check_parity(run_onnx: Callable[..., np.ndarray], run_torch: Callable[..., np.ndarray],
                 batches: Sequence[tuple[np.ndarray, ...]], *, tolerance: float,
                 min_agreement: float = 1.0) -> ParityResult:
    """Compare logits on every batch; ParityError if max |diff| > tolerance or top-1 agreement < min_agreement."""
    worst, agree, total = 0.0, 0, 0
    for batch in batches:
        got, want = np.asarray(run_onnx(*batch)), np.asarray(run_torch(*batch))
        if got.shape != want.shape:
            raise ParityError(f"ONNX logits have shape {got.shape}, PyTorch {want.shape}")
        worst = max(worst, float(np.max(np.abs(got - want))))
        decisions = got.argmax(-1) == want.argmax(-1)
        if len(batch) == 2 and decisions.ndim == 2:  # per-token decisions: padding does not count
            decisions = decisions[np.asarray(batch[1]) > 0]
        agree += int(np.sum(decisions))
        total += int(decisions.size)
    result = ParityResult(max_abs_diff=worst, top1_agreement=agree / max(total, 1), tolerance=tolerance,
                          inputs=total)
    if not worst <= tolerance:
        raise ParityError(f"parity check failed: max |ONNX - PyTorch| = {worst:.3g} > tolerance {tolerance:g} over "
                          f"{total} inputs; the exported graph does not match the model")
    if result.top1_agreement < min_agreement:
        raise ParityError(f"parity check failed: top-1 agreement {result.top1_agreement:.1%} < "
                          f"{min_agreement:.0%} over {total} inputs")
    return result


def export_onnx(model_dir: str | Path, out_dir: str | Path, *, int8: bool = False, texts: Sequence[str] = (),
                tolerance: float = FP32_TOLERANCE, int8_tolerance: float | None = None, overwrite: bool = False,
                log: Callable[[str], None] = lambda _m: None) -> ExportReport:
    """Export the package in ``model_dir`` to ``out_dir`` and check parity; see the module docstring."""
    import torch

    from fedclinic.models import build_model
    from fedclinic.package import ModelPackage

    if not tolerance > 0 or not (int8_tolerance is None or int8_tolerance > 0):
        raise ConfigError("tolerances must be > 0")
    src, out = Path(model_dir), Path(out_dir)
    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder; give a model package folder (e.g. from `fedclinic task download`)")
    if (out / "model.onnx").exists() and not overwrite:
        raise ConfigError(f"{out / 'model.onnx'} exists; choose another OUT_DIR or pass --overwrite")
    from fedclinic.model_card import read_card

    source_card = read_card(src)  # before any work: an unreadable card is reported at once
    package = ModelPackage.load(src)
    if package.meta.get("family") == "question-answering":
        raise ConfigError("ONNX export of question-answering (causal LM) models is not available yet: it needs "
                          "past key/values and a generation loop; serve the model with PyTorch for now")
    loaded = build_model(package)
    if int8_tolerance is None:  # per-token scores: the maximum runs over every token of every input
        int8_tolerance = INT8_TOKEN_TOLERANCE if loaded.family == "token-classification" else INT8_TOLERANCE
    module, input_names = _wrapper(loaded)
    batches = parity_inputs(loaded, texts=texts)
    example = tuple(torch.from_numpy(x) for x in batches[-1])
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic: dict[str, dict[int, Any]] = {name: {0: batch} for name in input_names}
    if len(input_names) == 2:
        seq = torch.export.Dim("seq", min=2, max=max(loaded.max_length, 2))
        for name in input_names:
            dynamic[name][1] = seq
    out.mkdir(parents=True, exist_ok=True)
    # everything is written to a staging folder and moved into OUT_DIR only when every check passed, so a
    # failed (re-)export leaves an existing bundle exactly as it was
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
    try:
        report = _export_into(stage, module, example, dynamic, input_names, batches, loaded, package, int8=int8,
                              tolerance=tolerance, int8_tolerance=int8_tolerance, log=log, card=source_card)
        for name in report.files + ["export_report.json"]:
            (stage / name).replace(out / name)
        if not int8:
            (out / "model.int8.onnx").unlink(missing_ok=True)  # it belonged to an earlier export
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return report


def _export_into(stage: Path, module, example, dynamic, input_names, batches, loaded, package, *, int8: bool,
                 tolerance: float, int8_tolerance: float, log, card: dict | None = None) -> ExportReport:
    import onnx
    import onnxruntime as ort
    import torch

    out = stage  # every file below lands in the staging folder
    tmp = out / "model.onnx.tmp"
    log(f"exporting {loaded.family}/{loaded.architecture} to ONNX (opset {OPSET})")
    _forget_rnn_kernels()
    with torch.no_grad(), warnings.catch_warnings():
        # batch and seq of every input share one constraint; the exporter says so once per axis
        warnings.filterwarnings("ignore", message="# The axis name")
        program = torch.onnx.export(module, example, dynamo=True, opset_version=OPSET, input_names=input_names,
                                    output_names=["logits"], dynamic_shapes=dynamic,
                                    verbose=False)
        program.save(str(tmp))
    onnx.checker.check_model(str(tmp))

    def torch_logits(*xs):
        with torch.no_grad():
            return module(*(torch.from_numpy(x) for x in xs)).float().numpy()

    def session(path: Path):
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def logits_of(sess):
        return lambda *xs: sess.run(["logits"], dict(zip(input_names, xs)))[0]

    crf = getattr(loaded.module, "crf", None)
    if crf is not None:
        _append_crf(tmp, crf)
        want_paths = torch_paths(loaded, batches)  # PyTorch's Viterbi, once for the fp32 and int8 checks
    fp32_session = session(tmp)
    fp32 = check_parity(logits_of(fp32_session), torch_logits, batches, tolerance=tolerance)
    if crf is not None:
        fp32.path_agreement = check_paths(fp32_session, want_paths, batches, min_agreement=1.0)
    tmp.replace(out / "model.onnx")
    log(f"fp32 parity: max |ONNX - PyTorch| = {fp32.max_abs_diff:.3g} over {fp32.inputs} inputs "
        f"(tolerance {tolerance:g})")
    report = ExportReport(family=loaded.family, architecture=loaded.architecture,
                          opset=OPSET, fp32=fp32, files=["model.onnx"])
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        qtmp = out / "model.int8.onnx.tmp"
        # the exporter's recorded intermediate shapes can contradict onnx's own inference (a fixed example
        # size); the quantizer re-infers them, so hand it the graph without them
        graph = onnx.load(str(out / "model.onnx"))
        graph.graph.ClearField("value_info")
        plain = out / "model.plain.onnx.tmp"
        onnx.save(graph, str(plain))
        try:
            # per-channel weight scales on the MatMuls: on MiniLM, per-tensor scales moved logits by up to 2.3
            # and flipped 4.5 % of test predictions; per-channel MatMul-only flipped none (max |diff| 0.45)
            quantize_dynamic(str(plain), str(qtmp), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"])
        finally:
            plain.unlink(missing_ok=True)
        int8_session = session(qtmp)
        report.int8 = check_parity(logits_of(int8_session), torch_logits, batches, tolerance=int8_tolerance,
                                   min_agreement=INT8_MIN_AGREEMENT)
        if crf is not None:
            report.int8.path_agreement = check_paths(int8_session, want_paths, batches, min_agreement=0.0)
        qtmp.replace(out / "model.int8.onnx")
        report.files.append("model.int8.onnx")
        log(f"int8 parity: max |ONNX - PyTorch| = {report.int8.max_abs_diff:.3g}, top-1 agreement "
            f"{report.int8.top1_agreement:.1%} (tolerance {int8_tolerance:g}, >= {INT8_MIN_AGREEMENT:.0%})")
    for name in _SIDE_FILES:
        if name in package.files:
            (out / name).write_bytes(package.files[name])
            report.files.append(name)
    _write_bundle_card(out, report, card, package, input_names, ["logits"] + (["tags"] if crf is not None else []))
    (out / "export_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _forget_rnn_kernels() -> None:
    """Drop the kernels torch memoised for ``aten.lstm``/``aten.gru`` so this export traces them afresh.

    For dynamic sequence lengths the exporter swaps in a while-loop decomposition of the LSTM while it traces,
    but an op's memoised kernel (from an earlier export in this process) wins over the swap: the LSTM is then
    unrolled over the example's length, the exporter pins ``seq`` to that length, and the graph refuses every
    other length (seen with a second ``lstm``/``cnn-bilstm-crf`` export in one process).
    """
    import torch

    for op in (torch.ops.aten.lstm.input, torch.ops.aten.gru.input):
        cache = getattr(op, "_dispatch_cache", None)
        if isinstance(cache, dict):
            cache.clear()


def _write_bundle_card(out: Path, report: ExportReport, card: dict | None, package, inputs: list[str],
                       outputs: list[str]) -> None:
    """The package's model card (or one made from fedclinic_model.json) plus the export section, into ``out``."""
    from fedclinic.model_card import add_export, card_for_bundle, write_card

    report.files += [CARD_FILE, CARD_MARKDOWN_FILE]
    base = card_for_bundle(card, package.meta, model_hash=package.manifest().model_hash)
    write_card(out, add_export(base, asdict(report), inputs=inputs, outputs=outputs))


def _append_crf(path: Path, crf) -> None:
    """Append the CRF's Viterbi decoding to the exported emission graph at ``path`` (output ``tags``)."""
    import onnx

    from fedclinic.onnx_crf import append_viterbi

    model = onnx.load(str(path))
    model.graph.ClearField("value_info")  # the exporter's recorded shapes are of its example; let onnx re-infer
    for output in model.graph.output:
        if output.name == "logits":
            # an LSTM traced by the exporter pins the emissions' sequence axis to the example's length (its
            # meta kernel unrolls over time); onnxruntime would then plan the Viterbi's per-step Split for that
            # length only. The graph itself computes any length: declare the axes dynamic again.
            dims = output.type.tensor_type.shape.dim
            dims[0].dim_param, dims[1].dim_param = "batch", "seq"
    append_viterbi(model, emissions="logits", mask="attention_mask",
                   transitions=crf.transitions.detach().cpu().numpy(),
                   start=crf.start_transitions.detach().cpu().numpy(), end=crf.end_transitions.detach().cpu().numpy())
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def torch_paths(loaded, batches) -> list[np.ndarray]:
    """PyTorch's Viterbi path ``[batch, seq]`` for every parity batch (``(input_ids, attention_mask)``)."""
    import torch

    with torch.no_grad():
        return [loaded.decode(torch.from_numpy(ids), torch.from_numpy(mask)).numpy() for ids, mask in batches]


def check_paths(session, want_paths: Sequence[np.ndarray], batches, *, min_agreement: float) -> float:
    """Share of sequences whose ONNX ``tags`` (from the onnxruntime ``session``) equal PyTorch's paths
    ``want_paths`` (:func:`torch_paths`) on non-padding positions; ParityError below ``min_agreement``."""
    same = total = 0
    for (ids, mask), want in zip(batches, want_paths):
        got = session.run(["tags"], {"input_ids": ids, "attention_mask": mask})[0]
        same += int(sum(np.array_equal(g[m > 0], w[m > 0]) for g, w, m in zip(got, want, mask)))
        total += len(ids)
    share = same / max(total, 1)
    if share < min_agreement:
        raise ParityError(f"parity check failed: the ONNX CRF path equals PyTorch's Viterbi path on {share:.1%} of "
                          f"{total} sequences (needs {min_agreement:.0%})")
    return share


def add_export_commands(sub) -> None:
    """``fedclinic export onnx MODEL_DIR OUT_DIR [--int8]``."""
    exp = sub.add_parser("export", help="export a model package for serving")
    esub = exp.add_subparsers(dest="export_cmd", required=True)
    p = esub.add_parser("onnx", help="export to ONNX and check parity against PyTorch")
    p.add_argument("model_dir", help="a model package folder (fedclinic task download)")
    p.add_argument("out_dir")
    p.add_argument("--int8", action="store_true", help="also write a dynamically int8-quantized model")
    p.add_argument("--texts", help="JSONL with a 'text' field per row: held-out inputs for the parity check")
    p.add_argument("--tolerance", type=float, default=FP32_TOLERANCE, help="fp32 max |diff| allowed")
    p.add_argument("--int8-tolerance", type=float, default=None,
                   help=f"int8 max |diff| allowed (default {INT8_TOLERANCE:g}; {INT8_TOKEN_TOLERANCE:g} for per-token "
                        "NER scores)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in OUT_DIR")
    p.set_defaults(func=_export_command)


def _export_command(args) -> int:
    texts: list[str] = []
    if args.texts:
        path = Path(args.texts)
        if not path.is_file():
            raise ConfigError(f"{path} does not exist")
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    texts.append(str(json.loads(line)["text"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ConfigError(f"{path}:{i}: expected a JSON object with a 'text' field") from None
    export_onnx(args.model_dir, args.out_dir, int8=args.int8, texts=texts, tolerance=args.tolerance,
                int8_tolerance=args.int8_tolerance, overwrite=args.overwrite, log=lambda m: print(m, flush=True))
    print(f"wrote {Path(args.out_dir) / 'model.onnx'}" + (" and model.int8.onnx" if args.int8 else ""))
    return 0
