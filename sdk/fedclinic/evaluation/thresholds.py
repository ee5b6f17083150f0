"""Per-label decision thresholds of a multi-label model, tuned for F1 from score histograms that sites can sum.

Why: a multi-label model trained on skewed sites often ranks a rare label well (high AUC) while its probability
never reaches 0.5, so the fixed cut-off never predicts it. Each label gets its own threshold, the one with the
best F1 on validation rows; the rows never move: every site sends only a histogram of its scores.

Bins (fixed, the same at every site): a probability ``p = sigmoid(logit)`` in [0, 1] falls in bin

    bin(p) = #{k in 1..B-1 : p >= k / B}          (B = :data:`BINS` = 50, so bin b holds [b/B, (b+1)/B))

A site reports, per label ``i`` and bin ``b``, ``count/thr/<i>/<b>/pos`` and ``count/thr/<i>/<b>/neg``: how many of
its evaluation rows carrying / not carrying the label scored in that bin (:func:`threshold_histogram`; bins with
no row are left out, a missing key reads as 0). Keys starting ``count/`` are raw counts that pooling *sums*
(the contract of the evaluation pool), so the pooled histogram is exactly the histogram of all sites' rows.

Tuning (:func:`tune_thresholds`): the candidate thresholds are the inner bin edges ``t_k = k / B``, k = 1..B-1
(0.02 .. 0.98). Predicting the label when ``p >= t_k`` selects exactly the rows of bins ``>= k``, so with ``P``
positive rows::

    TP(k) = sum_{b >= k} pos_b      FP(k) = sum_{b >= k} neg_b      FN(k) = P - TP(k)
    F1(k) = 2 TP / (2 TP + FP + FN) = 2 TP(k) / (TP(k) + FP(k) + P)

and the label's threshold is ``t_k`` of the best F1. Tie rule: among the candidates with the best F1 the one
closest to 0.5 wins (0.5 itself when it is among them), and of two equally close the higher one. A label with no
positive row in the pool keeps :data:`DEFAULT_THRESHOLD` (0.5): F1 is 0 everywhere, nothing to tune.
The same bins are used by :func:`tune_thresholds_from_scores` (one site's rows, or the simulator's), so the
federated tuning equals the tuning on the concatenated rows exactly (a test checks this).

Serving applies the same rule, ``p >= t``, with the thresholds the bundle carries (:mod:`fedclinic.serving.bundle`).
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping, Sequence

import numpy as np

#: histogram bins over the sigmoid probability [0, 1]
BINS = 50
#: the threshold of a label that cannot be tuned (no positive row), and of models without tuned thresholds
DEFAULT_THRESHOLD = 0.5
#: prefix of the histogram keys in an evaluation's values
HISTOGRAM_PREFIX = "count/thr/"
_KEY = re.compile(r"count/thr/(\d+)/(\d+)/(pos|neg)")


def probability_bins(probs: np.ndarray, bins: int = BINS) -> np.ndarray:
    """The bin of each probability (module doc): ``#{k in 1..bins-1 : p >= k / bins}``, int64, same shape."""
    edges = np.arange(1, bins, dtype=np.float64) / bins
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
    distance = np.abs(2 * candidates - bins)  # 2 * bins * |k / bins - 0.5|, in exact integers
    return float(candidates[distance == distance.min()].max() / bins)


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
    27/pos": 3.0, ...}``) or an object that exposes them as ``pooled_values(model)`` / ``final_evaluation`` /
    ``evaluation`` (a ``TaskStatus`` once the services record the final evaluation). ValueError when it holds no
    threshold histogram (the model is not multi-label, or no site evaluated it)."""
    pooled = evaluation_values(evaluation)
    if not any(k.startswith(HISTOGRAM_PREFIX) for k in pooled):
        raise ValueError("the evaluation holds no threshold histograms (count/thr/...): the model is not a "
                         "multi-label text model, or no site evaluated the final model")
    return tune_thresholds(pooled, labels, bins=bins)


def evaluation_values(evaluation: Any) -> dict[str, float]:
    """Pooled evaluation values as a plain ``dict[str, float]`` from a mapping, or from a status object holding
    them (see :func:`thresholds_from_evaluation`)."""
    if isinstance(evaluation, Mapping):
        return {str(k): float(v) for k, v in evaluation.items()}
    for name in ("final_evaluation", "evaluation"):
        value = getattr(evaluation, name, None)
        if value is None:
            continue
        for inner in ("pooled", "values"):  # a message with a pooled map, or the map itself
            nested = getattr(value, inner, None)
            if nested is not None and hasattr(nested, "items"):
                return {str(k): float(v) for k, v in nested.items()}
        if hasattr(value, "items"):
            return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"cannot read pooled evaluation values from a {type(evaluation).__name__}; pass the mapping "
                     "of the final evaluation's pooled values")


def check_thresholds(values: Any, labels: Sequence[str]) -> list[float]:
    """``values`` as one threshold per label in label order: a list (label order) or a mapping label -> threshold
    (every label named, no other). ValueError unless each is a finite number strictly between 0 and 1."""
    if isinstance(values, Mapping):
        unknown = sorted(set(map(str, values)) - set(labels))
        missing = [lab for lab in labels if lab not in values]
        if unknown or missing:
            raise ValueError(f"thresholds must name every label exactly: unknown {unknown}, missing {missing}")
        values = [values[lab] for lab in labels]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(labels):
        raise ValueError(f"thresholds must be one number per label ({len(labels)}), got {values!r}")
    out = []
    for lab, v in zip(labels, values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 < v < 1.0):
            raise ValueError(f"threshold of label {lab!r} must be a probability strictly between 0 and 1, got {v!r}")
        out.append(float(v))
    return out


__all__ = ["BINS", "DEFAULT_THRESHOLD", "HISTOGRAM_PREFIX", "best_threshold", "check_thresholds", "evaluation_values",
           "pooled_histograms", "probability_bins", "sigmoid", "threshold_histogram", "thresholds_from_evaluation",
           "tune_thresholds", "tune_thresholds_from_scores", "tuned_rows"]
