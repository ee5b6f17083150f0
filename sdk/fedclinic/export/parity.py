"""Parity of an exported graph with PyTorch: the tolerances, the held-out inputs, the checks and the report.

Every family's export (:mod:`fedclinic.export.onnx_export`, :mod:`fedclinic.export.causal_lm`) feeds the same
inputs through PyTorch and onnxruntime and fails with :class:`ParityError` outside the stated tolerance; the
figures go into ``export_report.json`` (:class:`ExportReport`) and the bundle's model card
(:func:`write_bundle_card`). The tolerances and their reasons are in :mod:`fedclinic.export.onnx_export`'s
docstring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from fedclinic.data.image import load_image
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.base import encode_texts
from fedclinic.spec.model_card import add_export, card_for_bundle, write_card
from fedclinic.transport.package import CARD_FILE, CARD_MARKDOWN_FILE

OPSET = 18
IMAGE_TEXT = "image-text-classification"
FP32_TOLERANCE = 1e-4
#: question-answering first-step logits: a 30-layer LM's logits reach |40| (float32 spacing ~4e-6 there); on
#: SmolLM2-135M the exported graph differs from PyTorch by 1.1e-4 at most, and PyTorch differs from itself by
#: 5.7e-5 between a prompt run alone and in a padded batch. Identical greedy tokens carry the decision.
QA_FP32_TOLERANCE = 1e-3
INT8_TOLERANCE = 1.0
#: per-token scores (NER): the maximum runs over every token of every input, thousands of values instead of one
#: row per input, so its tail is longer; token agreement and the CRF path agreement carry the decision
INT8_TOKEN_TOLERANCE = 2.0
INT8_MIN_AGREEMENT = 0.95


@dataclass
class ParityResult:
    max_abs_diff: float
    top1_agreement: float     # share of argmax decisions (per row, or per token) that agree with PyTorch
    tolerance: float | None   # None: the figure is reported, not checked (question-answering int8 by default)
    inputs: int
    path_agreement: float | None = None  # CRF: share of sequences whose ONNX Viterbi path equals PyTorch's
    #: question-answering: share of PyTorch's greedy answer tokens (each answer closed by its EOS) that the
    #: ONNX loop generated identically before its first divergence (fp32 must be 1.0), and how many there were
    token_agreement: float | None = None
    generated_tokens: int | None = None
    #: multi-label (image-text): share of the per-label decisions (logit > 0) that agree with PyTorch's
    label_agreement: float | None = None


@dataclass
class ExportReport:
    family: str
    architecture: str
    opset: int
    fp32: ParityResult
    int8: ParityResult | None = None
    files: list[str] = field(default_factory=list)
    #: BERT encoders: layers whose attention runs as one onnxruntime Attention op (fedclinic.export.encoder_fusion)
    fused_attention_layers: int = 0


class ParityError(IntegrityError):
    """The exported graph does not compute what the PyTorch model computes (within the stated tolerance)."""


def parity_inputs(loaded, *, texts: Sequence[str] = (), seed: int = 0,
                  images: Sequence[str | Path] | None = None) -> list[tuple[np.ndarray, ...]]:
    """Held-out inputs: ``texts`` tokenized with the model's tokenizer, or seeded random batches of sizes 1, 3
    and 8 (text: lengths up to the model's max_length, right-padded like the trainer pads).

    Image-text: ``(image, input_ids, attention_mask)``; ``images`` (files, one per text) are decoded and
    preprocessed by :func:`fedclinic.data.image.load_image`, else each row gets seeded random pixels uniform over
    the preprocessed range ``[(0 - mean) / std, (1 - mean) / std]``."""
    if loaded.family == IMAGE_TEXT:
        return _image_text_parity_inputs(loaded, texts=texts, seed=seed, images=images)
    if images:
        raise ConfigError(f"parity images are for {IMAGE_TEXT} models; this one is {loaded.family}")
    rng = np.random.default_rng(seed)
    if loaded.family == "feature-classification":
        return [(rng.normal(size=(b, loaded.num_features)).astype(np.float32),) for b in (1, 3, 8)]
    return _token_parity_inputs(loaded, texts, rng)


def _token_parity_inputs(loaded, texts: Sequence[str], rng: np.random.Generator) -> list[tuple[np.ndarray, ...]]:
    """``(input_ids, attention_mask)`` batches of ``texts`` (8 a batch), or seeded random ones (see parity_inputs)."""
    max_len = loaded.max_length
    batches = []
    if texts:

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


def _image_text_parity_inputs(loaded, *, texts: Sequence[str], seed: int,
                               images: Sequence[str | Path] | None) -> list[tuple[np.ndarray, ...]]:
    if images is not None and len(images) != len(texts):
        raise ConfigError(f"{len(images)} parity images for {len(texts)} texts; give one image per text")
    rng = np.random.default_rng(seed)
    text_batches = _token_parity_inputs(loaded, texts, rng)
    size, mean, std = loaded.image_size, loaded.image_mean, loaded.image_std
    batches, start = [], 0
    for ids, mask in text_batches:
        n = len(ids)
        if images is not None:
            px = np.stack([load_image(path, size=size, mean=mean, std=std) for path in images[start:start + n]])
        else:
            px = ((rng.uniform(0.0, 1.0, size=(n, 1, size, size)) - mean) / std).astype(np.float32)
        batches.append((px, ids, mask))
        start += n
    return batches


def check_parity(run_onnx: Callable[..., np.ndarray], run_torch: Callable[..., np.ndarray],
                 batches: Sequence[tuple[np.ndarray, ...]], *, tolerance: float,
                 min_agreement: float = 1.0, multi_label: bool = False) -> ParityResult:
    """Compare logits on every batch; ParityError if max |diff| > tolerance or the agreement < min_agreement: top-1
    agreement, or with ``multi_label`` the per-label decision (logit > 0) agreement."""
    worst, agree, total = 0.0, 0, 0
    label_same, label_total = 0, 0
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
        if multi_label:
            label_same += int(np.sum((got > 0) == (want > 0)))
            label_total += int(got.size)
    result = ParityResult(max_abs_diff=worst, top1_agreement=agree / max(total, 1), tolerance=tolerance,
                          inputs=total, label_agreement=label_same / max(label_total, 1) if multi_label else None)
    if not worst <= tolerance:
        raise ParityError(f"parity check failed: max |ONNX - PyTorch| = {worst:.3g} > tolerance {tolerance:g} over "
                          f"{total} inputs; the exported graph does not match the model")
    if result.label_agreement is not None:
        if result.label_agreement < min_agreement:
            raise ParityError(f"parity check failed: per-label decision agreement {result.label_agreement:.1%} < "
                              f"{min_agreement:.0%} over {label_total} label decisions of {total} inputs")
    elif result.top1_agreement < min_agreement:
        raise ParityError(f"parity check failed: top-1 agreement {result.top1_agreement:.1%} < "
                          f"{min_agreement:.0%} over {total} inputs")
    return result


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


def write_bundle_card(out: Path, report: ExportReport, card: dict | None, package, inputs: list[str],
                       outputs: list[str], notes: Sequence[str] = ()) -> None:
    """The package's model card (or one made from fedclinic_model.json) plus the export section, into ``out``;
    ``notes`` are appended to the card's notes (figures the export section's table does not show)."""
    report.files += [CARD_FILE, CARD_MARKDOWN_FILE]
    base = card_for_bundle(card, package.meta, model_hash=package.manifest().model_hash)
    if notes:
        base = {**base, "notes": [*(base.get("notes") or []), *notes]}
    write_card(out, add_export(base, asdict(report), inputs=inputs, outputs=outputs))


