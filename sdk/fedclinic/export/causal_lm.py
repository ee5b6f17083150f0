"""ONNX export of a question-answering (causal LM) package, with past key/values, checked by generation.

``fedclinic export onnx MODEL_DIR OUT_DIR [--int8]`` on a question-answering package writes ONE graph,
``model.onnx`` (opset 18), that computes one decoder step::

    inputs   input_ids       int64 [batch, seq]
             attention_mask  int64 [batch, total]            total = past + seq (1 = real token, 0 = padding)
             position_ids    int64 [batch, seq]
             past_key_values.{i}.key, past_key_values.{i}.value
                             float32 [batch, kv_heads, past, head_dim]    for every layer i; past may be 0
    outputs  logits          float32 [batch, seq, vocab]
             present.{i}.key, present.{i}.value
                             float32 [batch, kv_heads, past + seq, head_dim]

``batch``, ``seq``, ``total`` and ``past`` are dynamic. The first step of an answer feeds the left-padded prompt
with ``past`` of length 0; every later step feeds one token per row and the previous step's ``present`` as
``past``. :mod:`fedclinic.serving.generate` runs that loop on onnxruntime with numpy only.

Exporter: ``torch.onnx.export(..., dynamo=True)``, the project's exporter. The HF module takes its cache as a
``transformers.DynamicCache`` object, which the exporter cannot take as a graph input, so the exported module
is a small wrapper (:class:`DecoderWithPast`) whose inputs are the flat tensors above; it builds the
``DynamicCache`` from them inside ``forward`` (``DynamicCache(ddp_cache_data=[(key, value), ...])``, the
transformers 5 API) and returns the updated cache's tensors. No fallback to the TorchScript exporter is
needed (dynamo exports GPT-2 and Llama this way). The graph is traced with ``past`` >= 1 (the exporter
specialises sizes 0 and 1), but what it computes does not depend on the size, and every parity check below
runs the first step with ``past = 0``, so a graph that mishandled it would fail the export.

The output embedding is tied to the input embedding (one weight in the graph).

Parity (the export fails with :class:`fedclinic.export.onnx_export.ParityError`, leaving nothing behind, unless):

- first-step logits: on the parity prompts (left-padded batches of up to :data:`PARITY_BATCH`), the maximum
  absolute difference between onnxruntime's and PyTorch's logits over the real (non-padding) prompt positions
  is at most ``tolerance`` (default :data:`fedclinic.export.onnx_export.QA_FP32_TOLERANCE`, 1e-3: an LM's logits are large,
  |40| on SmolLM2-135M, where float32 rounding alone moves them by ~1e-4: measured 1.1e-4 between the graph and
  PyTorch, and 5.7e-5 between PyTorch runs of one prompt alone and in a padded batch; tiny test models stay
  below 1e-5). Padding positions are left out: their values are never used (every later step masks them) and
  the two runtimes fill fully masked attention rows differently;
- generation: greedy answers from the onnxruntime loop are token-for-token IDENTICAL to
  :meth:`CausalLMModel.generate_ids <fedclinic.models.causal_lm.CausalLMModel.generate_ids>` (same prompts, same
  batching, the package's ``max_new_tokens``).

The parity questions are ``--texts`` rows (their ``text`` is the question, ``context`` optional) or
:data:`DEFAULT_QUESTIONS`.

int8 (``--int8``): the MatMul weights are quantized like the other families' (dynamic, per channel). Reported
against PyTorch's fp32 model: the first-step logits difference, the top-1 agreement over the prompt positions
and the greedy *token agreement*: the share of PyTorch's greedy answer tokens (each answer closed by its EOS)
that the int8 loop produced identically before its first divergence. These are reported, not checked (one early
divergence changes the rest of an answer, so a token threshold would reject usable models at random), unless
``int8_tolerance`` is given: then the first-step logits difference must stay within it.

Bundle: ``model.onnx`` (``model.int8.onnx``), ``tokenizer.json``, ``config.json`` and the tokenizer's side files,
``fedclinic_model.json`` (the package's: prompt settings, EOS/BOS/padding ids, ``max_length``,
``generation.max_new_tokens``; plus ``max_positions``, the model's position limit, so the serving loop needs no
HF config), ``export_report.json`` and the model card with an ``export`` section and a note stating the
generation parity.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fedclinic.errors import ConfigError
from fedclinic.export.parity import OPSET, ExportReport, ParityError, ParityResult, write_bundle_card
from fedclinic.export.quantize import quantize_int8
from fedclinic.serving.generate import (
    ATTENTION_MASK,
    INPUT_IDS,
    LOGITS,
    POSITION_IDS,
    OnnxCausalLM,
    past_name,
    present_name,
)
from fedclinic.data.qa_prompt import left_pad
from fedclinic.transport.package import meta_bytes, META_FILE

#: parity questions when the export is given none: (question, context)
DEFAULT_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is sertraline used for?", ""),
    ("What are the common side effects of metformin?", ""),
    ("Which drug was the patient given?", "The patient has a chest infection and was given amoxicillin."),
)
#: prompts per left-padded batch in the parity checks (the same batching for PyTorch and onnxruntime)
PARITY_BATCH = 8
#: bundle files copied from the package besides fedclinic_model.json (which gets max_positions)
_SIDE_FILES = ("tokenizer.json", "config.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json")
#: sizes of the traced example (distinct, >= 2: the exporter specialises 0 and 1 and merges equal sizes)
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST = 3, 5, 7
#: axis limit when the model has no position limit
_NO_LIMIT = 8192


def _decoder_class():
    import torch

    class DecoderWithPast(torch.nn.Module):
        """The HF causal LM over flat tensors: ``(input_ids, attention_mask, position_ids, key_0, value_0, ...)``
        -> ``(logits, present key_0, value_0, ...)``; the ``DynamicCache`` is built inside."""

        def __init__(self, module, num_layers: int) -> None:
            super().__init__()
            self.model = module
            self.num_layers = num_layers

        def forward(self, input_ids, attention_mask, position_ids, *past):
            from transformers import DynamicCache

            # one full-attention DynamicLayer per layer: right for the allowed model types (gpt2, llama), which
            # have no sliding-window layers
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return DecoderWithPast


def kv_layout(module) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of the module's key/value cache, read off one real forward step."""
    import torch

    with torch.no_grad():
        ids = torch.zeros((1, 2), dtype=torch.long)
        out = module(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    layers = out.past_key_values.layers
    _, heads, _, head_dim = layers[0].keys.shape
    return len(layers), int(heads), int(head_dim)


def export_decoder(module, path: Path, *, max_positions: int | None) -> tuple[list[str], list[str]]:
    """Export ``module`` (an HF ``*ForCausalLM``, eval mode) as the decoder-step graph of the module docstring
    to ``path``; returns the graph's (input names, output names). The graph is checked with ``onnx.checker``."""
    import onnx
    import torch

    layers, heads, head_dim = kv_layout(module)
    wrapper = _decoder_class()(module, layers).eval()
    kv = [past_name(i, k) for i in range(layers) for k in ("key", "value")]
    inputs = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS, *kv]
    outputs = [LOGITS] + [present_name(i, k) for i in range(layers) for k in ("key", "value")]
    b, s, p = _EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST
    vocab = int(module.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    example = (torch.randint(0, vocab, (b, s), generator=gen), torch.ones((b, p + s), dtype=torch.long),
               torch.arange(p, p + s).expand(b, s).contiguous(),
               *[torch.randn((b, heads, p, head_dim), generator=gen) for _ in range(2 * layers)])
    limit = max_positions or _NO_LIMIT
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=limit)
    total = torch.export.Dim("total", min=1, max=2 * limit)
    past = torch.export.Dim("past", min=1, max=limit)
    dynamic = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq},
               tuple({0: batch, 2: past} for _ in range(2 * layers)))
    with torch.no_grad(), warnings.catch_warnings():
        # axes sharing one Dim are announced once per input; pytree's LeafSpec deprecation comes from the exporter
        warnings.filterwarnings("ignore", message="# The axis name")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        program = torch.onnx.export(wrapper, example, dynamo=True, opset_version=OPSET, input_names=inputs,
                                    output_names=outputs, dynamic_shapes=dynamic, verbose=False)
        program.save(str(path))
    onnx.checker.check_model(str(path))
    return inputs, outputs


def torch_prompt_logits(loaded, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's first-step logits on a left-padded prompt batch (the layout of :func:`left_pad`)."""
    import torch

    ids, mask, positions = (torch.from_numpy(a) for a in left_pad(prompts, loaded.pad_id))
    with torch.no_grad():
        logits = loaded.module(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return logits.float().numpy(), mask.numpy()


def token_agreement(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> tuple[float, int]:
    """Share of ``want``'s tokens (each row closed by one end marker, so an early or missing EOS counts) that
    ``got`` reproduced before its first divergence, and that token count."""
    same = total = 0
    for g, w in zip(got, want, strict=True):
        g, w = list(g) + [None], list(w) + [None]
        k = 0
        while k < min(len(g), len(w)) and g[k] == w[k]:
            k += 1
        same += k
        total += len(w)
    return same / max(total, 1), total


def check_decoder(lm: OnnxCausalLM, loaded, prompts: Sequence[Sequence[int]], want_tokens: Sequence[Sequence[int]],
                  *, tolerance: float | None, identical: bool, batch_size: int = PARITY_BATCH,
                  max_new_tokens: int | None = None) -> tuple[ParityResult, list[list[int]]]:
    """Compare the graph behind ``lm`` with ``loaded`` (the PyTorch :class:`CausalLMModel`) on ``prompts``.

    First-step logits on the real prompt positions: ParityError when the maximum absolute difference exceeds
    ``tolerance`` (None: not checked). Greedy generation: ``want_tokens`` are PyTorch's greedy tokens for
    ``prompts`` (``loaded.generate_ids(prompts, batch_size=batch_size)``); with ``identical`` a ParityError
    names the first prompt whose ONNX tokens differ. Returns the figures and the ONNX tokens."""
    worst, agree, positions = 0.0, 0, 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        got, mask = lm.prompt_logits(chunk)
        want, _ = torch_prompt_logits(loaded, chunk)
        if got.shape != want.shape:
            raise ParityError(f"ONNX logits have shape {got.shape}, PyTorch {want.shape}")
        real = mask > 0
        worst = max(worst, float(np.max(np.abs(got[real] - want[real]))))
        agree += int(np.sum(got[real].argmax(-1) == want[real].argmax(-1)))
        positions += int(real.sum())
    if tolerance is not None and not worst <= tolerance:
        raise ParityError(f"parity check failed: max |ONNX - PyTorch| = {worst:.3g} > tolerance {tolerance:g} on the "
                          f"first-step logits of {len(prompts)} prompts ({positions} prompt tokens); the exported "
                          "graph does not match the model")
    max_new = loaded.max_new_tokens if max_new_tokens is None else max_new_tokens
    got_tokens = lm.generate_ids(prompts, max_new_tokens=max_new, batch_size=batch_size)
    share, total = token_agreement(got_tokens, want_tokens)
    if identical:
        for i, (g, w) in enumerate(zip(got_tokens, want_tokens)):
            if list(g) != list(w):
                k = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                raise ParityError(f"parity check failed: the ONNX greedy answer to prompt {i} differs from PyTorch's "
                                  f"at generated token {k} (ONNX {list(g)[:k + 1]}..., PyTorch {list(w)[:k + 1]}...); "
                                  "the exported graph does not generate what the model generates")
    result = ParityResult(max_abs_diff=worst, top1_agreement=agree / max(positions, 1), tolerance=tolerance,
                          inputs=len(prompts), token_agreement=share, generated_tokens=total)
    return result, got_tokens


def parity_prompts(loaded, questions: Sequence[str] = (), contexts: Sequence[str] | None = None) -> list[list[int]]:
    """Prompt ids of the parity questions (``questions``/``contexts``, or :data:`DEFAULT_QUESTIONS`), built and
    truncated as in training."""
    if not questions:
        questions, contexts = [q for q, _ in DEFAULT_QUESTIONS], [c for _, c in DEFAULT_QUESTIONS]
    if contexts is not None and len(contexts) != len(questions):
        raise ConfigError(f"{len(contexts)} contexts for {len(questions)} parity questions; give one per question")
    return loaded.prompt_ids(list(questions), None if contexts is None else list(contexts))


def bundle_meta(loaded) -> dict[str, Any]:
    """The bundle's ``fedclinic_model.json``: the package's plus ``max_positions``."""
    return {**loaded.meta, "max_positions": loaded.max_positions}


def export_causal_lm_into(stage: Path, loaded, package, *, int8: bool, questions: Sequence[str] = (),
                          contexts: Sequence[str] | None = None, tolerance: float, int8_tolerance: float | None,
                          log: Callable[[str], None], card: dict | None = None) -> ExportReport:
    """Export the built :class:`CausalLMModel` ``loaded`` of ``package`` into the folder ``stage`` and run the
    parity checks of the module docstring; returns the report (written there as ``export_report.json``)."""
    import onnxruntime as ort

    module = loaded.module.eval()
    prompts = parity_prompts(loaded, questions, contexts)
    tmp = stage / "model.onnx.tmp"
    log(f"exporting {loaded.family}/{loaded.architecture} ({module.config.model_type}) to ONNX with past key/values "
        f"(opset {OPSET})")
    inputs, outputs = export_decoder(module, tmp, max_positions=loaded.max_positions)

    def decoder(path: Path) -> OnnxCausalLM:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return OnnxCausalLM(session, eos_id=loaded.eos_id, pad_id=loaded.pad_id, max_positions=loaded.max_positions)

    want = loaded.generate_ids(prompts, batch_size=PARITY_BATCH)  # PyTorch's greedy answers: the reference
    fp32, _ = check_decoder(decoder(tmp), loaded, prompts, want, tolerance=tolerance, identical=True)
    tmp.replace(stage / "model.onnx")
    log(f"fp32 parity: max |ONNX - PyTorch| = {fp32.max_abs_diff:.3g} on first-step logits (tolerance "
        f"{tolerance:g}); greedy answers to {fp32.inputs} questions identical to PyTorch's ({fp32.generated_tokens} "
        "tokens)")
    report = ExportReport(family=loaded.family, architecture=loaded.architecture, opset=OPSET, fp32=fp32,
                          files=["model.onnx"])
    notes = [f"ONNX export: greedy answers to {fp32.inputs} parity questions are token-for-token identical to "
             f"PyTorch's ({fp32.generated_tokens} tokens, EOS included); first-step logits max |diff| "
             f"{fp32.max_abs_diff:.3g}."]
    if int8:
        qtmp = stage / "model.int8.onnx.tmp"
        quantize_int8(stage / "model.onnx", qtmp)
        report.int8, _ = check_decoder(decoder(qtmp), loaded, prompts, want, tolerance=int8_tolerance,
                                       identical=False)
        qtmp.replace(stage / "model.int8.onnx")
        report.files.append("model.int8.onnx")
        checked = f"tolerance {int8_tolerance:g}" if int8_tolerance is not None else "reported, not checked"
        log(f"int8 parity: max |ONNX - PyTorch| = {report.int8.max_abs_diff:.3g} on first-step logits, top-1 "
            f"agreement {report.int8.top1_agreement:.1%}, greedy token agreement {report.int8.token_agreement:.1%} "
            f"({checked})")
        notes.append(f"int8 graph: {report.int8.token_agreement:.1%} of PyTorch's greedy answer tokens reproduced "
                     f"before the first divergence; first-step logits max |diff| {report.int8.max_abs_diff:.3g}, "
                     f"top-1 agreement {report.int8.top1_agreement:.1%} ({checked}).")
    (stage / META_FILE).write_bytes(meta_bytes(bundle_meta(loaded)))
    report.files.append(META_FILE)
    for name in _SIDE_FILES:
        if name in package.files:
            (stage / name).write_bytes(package.files[name])
            report.files.append(name)
    write_bundle_card(stage, report, card, package, inputs, outputs, notes=notes)
    (stage / "export_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


__all__ = ["DEFAULT_QUESTIONS", "PARITY_BATCH", "bundle_meta", "check_decoder", "export_causal_lm_into",
           "export_decoder", "kv_layout", "parity_prompts", "token_agreement", "torch_prompt_logits"]
