"""Per-label decision thresholds of a multi-label model, tuned for F1 from score histograms that sites can sum.

Why: a multi-label model trained on skewed sites often ranks a rare label well (high AUC) while its probability
never reaches 0.5, so the fixed cut-off never predicts it. Each label gets its own threshold, the one with the
best F1 on validation rows; the rows never move: every site sends only a histogram of its scores.

Bins (fixed, the same at every site): the ``B - 1`` inner edges are probabilities evenly spaced in logit::

    t_k = sigmoid(L * (2k / B - 1)),  k = 1..B-1           B = :data:`BINS` = 50, L = :data:`LOGIT_RANGE` = 8

so ``t_25 = 0.5`` exactly, ``t_1 = 0.00046`` and ``t_49 = 0.99954``, with the finest steps near 0 and 1, where a
rare label's probabilities sit (equal steps of 0.02 would put every score of a 1 %-label into one or two bins).
A probability ``p`` falls in bin ``bin(p) = #{k : p >= t_k}`` (0..B-1). A site reports, per label ``i`` and bin
``b``, ``count/thr/<i>/<b>/pos`` and ``count/thr/<i>/<b>/neg``: how many of its evaluation rows carrying / not
carrying the label scored in that bin (:func:`threshold_histogram`; bins with no row are left out, a missing key
reads as 0). Keys starting ``count/`` are raw counts that pooling *sums* (the contract of the evaluation pool), so
the pooled histogram is exactly the histogram of all sites' rows.

Tuning (:func:`tune_thresholds`): the candidate thresholds are the inner edges ``t_k``. Predicting the label
when ``p >= t_k`` selects exactly the rows of bins ``>= k``, so with ``P`` positive rows::

    TP(k) = sum_{b >= k} pos_b      FP(k) = sum_{b >= k} neg_b      FN(k) = P - TP(k)
    F1(k) = 2 TP / (2 TP + FP + FN) = 2 TP(k) / (TP(k) + FP(k) + P)

and the label's threshold is ``t_k`` of the best F1. Tie rule: among the candidates with the best F1 the one
closest to 0.5 in bins (``|k - B/2|``) wins (0.5 itself when it is among them), and of two equally close the
higher one. A label with no positive row in the pool keeps :data:`DEFAULT_THRESHOLD` (0.5): F1 is 0 everywhere,
nothing to tune.
The same bins are used by :func:`tune_thresholds_from_scores` (one site's rows, or the simulator's), so the
federated tuning equals the tuning on the concatenated rows exactly (a test checks this).

Serving applies the same rule, ``p >= t``, with the thresholds the bundle carries (:mod:`fedclinic.serving.bundle`).
:func:`write_model_thresholds` / :func:`set_card_thresholds` put them into a downloaded model's card, from which
``fedclinic export onnx`` copies them into the signed bundle.

What leaves a site: per label and bin, two counts of its evaluation rows (no row, no score). A bin holding one
row says that one row scored in that range; the evaluation pool's small-cell rule (``eval_rows`` below the site's
``min_cell_rows``) applies to the whole evaluation, not to single bins.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError
from fedclinic.spec.card_thresholds import check_thresholds, thresholds_section
from fedclinic.spec.model_card import Card, build_card, read_card, write_card
from fedclinic.transport.package import ModelPackage

#: histogram bins over the sigmoid probability [0, 1] (edges evenly spaced in logit, see the module doc)
BINS = 50
#: the logit of the highest inner edge (the lowest is its negative)
LOGIT_RANGE = 8.0
#: the threshold of a label that cannot be tuned (no positive row), and of models without tuned thresholds
DEFAULT_THRESHOLD = 0.5
#: prefix of the histogram keys in an evaluation's values
HISTOGRAM_PREFIX = "count/thr/"
_KEY = re.compile(r"count/thr/(\d+)/(\d+)/(pos|neg)")


def bin_edges(bins: int = BINS) -> np.ndarray:
    """The inner edges ``t_1 .. t_{bins-1}`` (module doc), float64, increasing; the candidate thresholds."""
    k = np.arange(1, bins, dtype=np.float64)
    edges = sigmoid(LOGIT_RANGE * (2.0 * k / bins - 1.0))
    if bins % 2 == 0:
        edges[bins // 2 - 1] = 0.5  # exactly, whatever the rounding of sigmoid(0.0)
    return edges


def probability_bins(probs: np.ndarray, bins: int = BINS) -> np.ndarray:
    """The bin of each probability (module doc): ``#{k : p >= t_k}``, int64, same shape."""
    edges = bin_edges(bins)
    p = np.asarray(probs, dtype=np.float64)
    if not np.isfinite(p).all():
        raise ValueError("probabilities must be finite")
    return np.searchsorted(edges, p, side="right").astype(np.int64)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))`` in float64 without overflow warnings."""
    z = np.asarray(logits, dtype=np.float64)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    e = np.exp(z[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def threshold_histogram(truth: np.ndarray, probs: np.ndarray, *, bins: int = BINS) -> dict[str, float]:
    """The ``count/thr/<i>/<b>/pos|neg`` values of ``N`` rows (module doc): ``truth`` ``[N, C]`` 0/1,
    ``probs`` ``[N, C]`` sigmoid probabilities. Only non-empty bins are listed."""
    t = np.asarray(truth) > 0.5
    b = probability_bins(probs, bins)
    if t.shape != b.shape or t.ndim != 2:
        raise ValueError(f"truth and probabilities must both be [N, C]; got {t.shape} and {b.shape}")
    out: dict[str, float] = {}
    for i in range(t.shape[1]):
        for side, rows in (("pos", t[:, i]), ("neg", ~t[:, i])):
            counts = np.bincount(b[rows, i], minlength=bins)
            for k in np.flatnonzero(counts):
                out[f"{HISTOGRAM_PREFIX}{i}/{int(k)}/{side}"] = float(counts[k])
    return out


def pooled_histograms(pooled: Mapping[str, float], num_labels: int, *, bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """(pos, neg) count arrays ``[num_labels, bins]`` from evaluation values; other keys are ignored, missing bins
    read as 0. ValueError for a histogram key naming a label or bin out of range, or a count that is not a finite
    number >= 0 (a count is rounded to the nearest whole number)."""
    pos = np.zeros((num_labels, bins), dtype=np.float64)
    neg = np.zeros((num_labels, bins), dtype=np.float64)
    for key, value in pooled.items():
        if not key.startswith(HISTOGRAM_PREFIX):
            continue
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"{key!r} is not a threshold histogram key (count/thr/<label>/<bin>/pos|neg)")
        i, k = int(m.group(1)), int(m.group(2))
        if i >= num_labels or k >= bins:
            raise ValueError(f"{key!r} is outside {num_labels} labels x {bins} bins; were the values made for "
                             "another model?")
        v = float(value)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{key!r} = {value!r} is not a count")
        (pos if m.group(3) == "pos" else neg)[i, k] += round(v)
    return pos, neg


def best_threshold(pos: np.ndarray, neg: np.ndarray) -> float:
    """The F1-best inner bin edge of one label's histograms ``[bins]`` (module doc, tie rule included)."""
    bins = len(pos)
    positives = float(pos.sum())
    if positives <= 0:
        return DEFAULT_THRESHOLD
    tp = np.cumsum(pos[::-1])[::-1]   # tp[k] = rows with label, bin >= k
    fp = np.cumsum(neg[::-1])[::-1]
    k = np.arange(1, bins)
    f1 = 2.0 * tp[k] / (tp[k] + fp[k] + positives)
    best = f1.max()
    candidates = k[f1 == best]
    distance = np.abs(2 * candidates - bins)  # |k - bins/2|, doubled to stay in integers
    return float(bin_edges(bins)[candidates[distance == distance.min()].max() - 1])


def tune_thresholds(pooled: Mapping[str, float], labels: Sequence[str], *, bins: int = BINS) -> list[float]:
    """Each label's F1-best threshold (in ``labels`` order) from pooled evaluation values: the summed
    ``count/thr/...`` histograms of the sites' final-model evaluation (module doc for the math and the tie rule)."""
    pos, neg = pooled_histograms(pooled, len(labels), bins=bins)
    return [best_threshold(pos[i], neg[i]) for i in range(len(labels))]


def tune_thresholds_from_scores(truth: np.ndarray, scores: np.ndarray, *, bins: int = BINS,
                                logits: bool = False) -> list[float]:
    """The same tuning on rows at hand (one site's validation split, the simulator's pooled rows): ``truth``
    ``[N, C]`` 0/1 and ``scores`` ``[N, C]`` probabilities (or logits with ``logits=True``). Equal to
    :func:`tune_thresholds` of the summed histograms of any split of the same rows."""
    probs = sigmoid(scores) if logits else np.asarray(scores, dtype=np.float64)
    hist = threshold_histogram(truth, probs, bins=bins)
    return tune_thresholds(hist, [str(i) for i in range(np.asarray(truth).shape[1])], bins=bins)


def tuned_rows(pooled: Mapping[str, float], num_labels: int, *, bins: int = BINS) -> int:
    """How many rows the pooled histograms hold (each row is counted once per label; label 0's count)."""
    if num_labels < 1:
        return 0
    pos, neg = pooled_histograms(pooled, num_labels, bins=bins)
    return int(pos[0].sum() + neg[0].sum())


def thresholds_from_evaluation(evaluation: Any, labels: Sequence[str], *, bins: int = BINS) -> list[float]:
    """The SDK entry point: thresholds from a task's final-model evaluation.

    ``evaluation`` is the pooled values of the final model's evaluation, either a plain mapping (``{"count/thr/0/
    27/pos": 3.0, ...}``) or a ``TaskStatus`` (its ``results`` phase's pooled "final" model, or an "evaluate"
    task's "model"). ValueError when it holds no threshold histogram (the model is not multi-label, or no site evaluated
    it)."""
    pooled = evaluation_values(evaluation)
    if not any(k.startswith(HISTOGRAM_PREFIX) for k in pooled):
        raise ValueError("the evaluation holds no threshold histograms (count/thr/...): the model is not a "
                         "multi-label text model, or no site evaluated the final model")
    return tune_thresholds(pooled, labels, bins=bins)


def evaluation_values(evaluation: Any) -> dict[str, float]:
    """Pooled evaluation values as a plain ``dict[str, float]``: a mapping as is, or a ``TaskStatus``'s result
    phase's pooled "final" model (an "evaluate" task's "model"). ValueError for anything else."""
    if isinstance(evaluation, Mapping):
        return {str(k): float(v) for k, v in evaluation.items()}
    for model in ("final", "model"):
        pooled = next((p for p in getattr(getattr(evaluation, "results", None), "pooled", ()) if p.model == model), None)
        if pooled is not None:
            return {str(k): float(v) for k, v in pooled.values.items()}
    raise ValueError(f"cannot read pooled evaluation values from a {type(evaluation).__name__}; pass a TaskStatus "
                     "whose final evaluation has closed, or the mapping of its pooled values")


def set_card_thresholds(folder: str | os.PathLike[str], values: Any, *, source: str, rows: int | None = None,
                        sites: Sequence[str] | None = None, bins: int | None = None) -> Card:
    """Write per-label decision thresholds (a list in label order or a mapping label -> threshold) into the card of
    the model in ``folder`` (made from its ``fedclinic_model.json`` when it has none); returns the new card.
    ConfigError for a model that is not multi-label, or thresholds that do not fit its labels."""
    root = Path(folder)
    card = read_card(root)
    if card is None:
        package = ModelPackage.load(root)
        card = build_card(package.meta, model_hash=package.manifest().model_hash)
    if not card.get("multi_label"):
        raise ConfigError(f"the model in {root} is not multi-label: per-label thresholds do not apply")
    card = {**card, "thresholds": thresholds_section(values, list(card.get("labels") or []), source=source, rows=rows,
                                                     sites=sites, bins=bins)}
    write_card(root, card)
    return card


def write_model_thresholds(folder: str | Path, choice: Any, *, status: Any = None, source: str = "") -> list[float]:
    """Set the per-label thresholds of the model downloaded into ``folder`` (its card's ``thresholds`` section,
    which ``fedclinic export onnx`` carries into the bundle); returns them in label order.

    ``choice``: ``"tuned"`` (F1-best from the pooled final-model evaluation in ``status``:
    :func:`thresholds_from_evaluation`; the card records the rows and sites tuned on), a path to a JSON file
    holding a list (label order) or an object label -> threshold, or such a list or mapping itself.
    ConfigError when they do not fit the model's labels or the evaluation holds no histograms."""
    card = read_card(folder) or {}
    labels = list(card.get("labels") or ModelPackage.load(folder).meta.get("labels") or [])
    if isinstance(choice, str) and choice == "tuned":
        if status is None:
            raise ConfigError("tuned thresholds need the task's status with its final evaluation")
        try:
            values = thresholds_from_evaluation(status, labels)
        except ValueError as exc:
            raise ConfigError(f"cannot tune thresholds: {exc}") from None
        pooled = evaluation_values(status)
        sites = sorted(getattr(getattr(status, "final_evaluation", None), "sites", None) or card.get("sites") or [])
        set_card_thresholds(folder, values, source=source or "the final model's evaluation at the sites",
                            rows=tuned_rows(pooled, len(labels)), sites=sites, bins=BINS)
        return values
    if isinstance(choice, (str, os.PathLike)):
        path = Path(choice)
        try:
            choice = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--thresholds {path}: not a readable JSON file ({exc}); give a list (label order) or "
                              "an object label -> threshold, or 'tuned'") from None
        source = source or str(path)
    card = set_card_thresholds(folder, choice, source=source or "set by hand")
    return check_thresholds(card["thresholds"]["values"], labels)


__all__ = ["BINS", "DEFAULT_THRESHOLD", "HISTOGRAM_PREFIX", "LOGIT_RANGE", "best_threshold", "bin_edges", "check_thresholds", "evaluation_values",
           "pooled_histograms", "probability_bins", "sigmoid", "threshold_histogram", "thresholds_from_evaluation",
           "set_card_thresholds", "tune_thresholds", "tune_thresholds_from_scores", "tuned_rows",
           "write_model_thresholds"]
