"""Multi-label classification metrics (numpy only): per-label F1 and ROC AUC, their macro means.

Notation: ``N`` examples, ``C`` labels; ``truth`` is a 0/1 matrix ``[N, C]``, ``scores`` a real matrix ``[N, C]``
(any score that ranks like the predicted probability: logits, probabilities). A label is predicted when its
score exceeds ``threshold`` (0 for logits, which is probability 0.5).

ROC AUC of one label, by the rank formula (Mann-Whitney U; Hanley & McNeil 1982)::

    r_i  = rank of s_i among all N scores, 1-based, ties given their mid-rank
           (the mean of the ranks the tied group occupies)
    AUC  = (sum_{i positive} r_i - P (P + 1) / 2) / (P * Q)         P positives, Q negatives

which equals the pairwise definition ``P(s_pos > s_neg) + 0.5 * P(s_pos = s_neg)`` over all P*Q pairs (a test
checks this against the brute-force pair count). AUC is undefined (NaN) when a label has no positive or no
negative example in the set; macro AUC averages the labels where it is defined (NaN when none is).

F1 of one label: ``2 TP / (2 TP + FP + FN)``, and 0 when the label has no true and no predicted example
(scikit-learn's ``zero_division=0``). Macro F1 averages *all* labels; micro F1 is the same formula on TP, FP
and FN summed over the labels (every label decision counts once, so frequent labels weigh more).

``exact_match`` is the share of examples whose every label decision is right (named so that it does not read
as plain accuracy: with 18 labels it is near 0 for any useful model); ``label_accuracy`` the share of the
``N * C`` decisions that are right.

:func:`multilabel_evaluation` is what a multi-label family's ``evaluate()`` returns: these metrics on its logits,
its loss, ``n`` and the threshold histograms that sites' evaluations sum (:mod:`fedclinic.evaluation.thresholds`).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from fedclinic.evaluation.combine import defined_values
from fedclinic.evaluation.thresholds import sigmoid, threshold_histogram


def roc_auc(truth: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of one binary label by the mid-rank formula (module doc); NaN without both classes.

    ``truth``: ``[N]`` 0/1 (or bool); ``scores``: ``[N]`` finite reals. ``O(N log N)``.
    """
    y = np.asarray(truth).astype(bool).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"roc_auc needs one score per example: {y.shape[0]} labels, {s.shape[0]} scores")
    if not np.isfinite(s).all():
        raise ValueError("roc_auc: scores must be finite")
    pos = int(y.sum())
    neg = y.size - pos
    if pos == 0 or neg == 0:
        return math.nan
    ranks = midranks(s)
    return float((ranks[y].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def midranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of ``values`` (ascending); tied values all get the mean of the ranks they span."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    below = np.cumsum(counts) - counts          # how many values are strictly smaller than each unique value
    return (below + (counts + 1) / 2.0)[inverse]


def multilabel_scores(truth: np.ndarray, scores: np.ndarray, labels: Sequence[str], *,
                      threshold: float | Sequence[float] = 0.0, at_least: bool = False) -> dict[str, float]:
    """Per-label and overall metrics of a multi-label prediction (module doc for the definitions).

    A label is predicted when its score is > ``threshold`` (one value, or one per label in ``labels`` order; in
    the units of ``scores``), or >= it with ``at_least`` (how ``serve`` applies tuned thresholds to probabilities:
    ``multilabel_scores(y, probs, labels, threshold=tuned, at_least=True)`` is what the served model scores). Returns ``f1/<label>``, ``auc/<label>`` for every label, ``macro_f1``,
    ``macro_auc``, ``micro_f1``, ``exact_match`` and ``label_accuracy`` (the IU-CXR notebook's element-wise
    accuracy, without its "normal excludes every disease" rule).
    """
    t = np.asarray(truth) > 0.5
    s = np.asarray(scores, dtype=np.float64)
    if t.ndim != 2 or s.shape != t.shape:
        raise ValueError(f"truth and scores must both be [N, C]; got {t.shape} and {s.shape}")
    if t.shape[1] != len(labels):
        raise ValueError(f"{t.shape[1]} label columns but {len(labels)} label names")
    if t.shape[0] == 0:
        raise ValueError("no examples to score")
    cut = np.asarray(threshold, dtype=np.float64)
    if cut.ndim not in (0, 1) or (cut.ndim == 1 and cut.shape[0] != len(labels)):
        raise ValueError(f"threshold must be one number or one per label ({len(labels)})")
    pred = s >= cut if at_least else s > cut
    tp = (pred & t).sum(axis=0).astype(np.float64)
    fp = (pred & ~t).sum(axis=0)
    fn = (~pred & t).sum(axis=0)
    denom = 2 * tp + fp + fn
    f1 = np.divide(2 * tp, denom, out=np.zeros(len(labels)), where=denom > 0)
    micro_denom = float(denom.sum())
    aucs = [roc_auc(t[:, j], s[:, j]) for j in range(len(labels))]
    defined = [a for a in aucs if not math.isnan(a)]
    out: dict[str, float] = {}
    for j, name in enumerate(labels):
        out[f"f1/{name}"] = float(f1[j])
        out[f"auc/{name}"] = aucs[j]
    out["macro_f1"] = float(f1.mean())
    out["macro_auc"] = float(np.mean(defined)) if defined else math.nan
    out["micro_f1"] = 2.0 * float(tp.sum()) / micro_denom if micro_denom > 0 else 0.0
    out["exact_match"] = float((pred == t).all(axis=1).mean())
    out["label_accuracy"] = float((pred == t).mean())
    return out


def multilabel_evaluation(truth: np.ndarray, logits: np.ndarray, labels: Sequence[str], *,
                          loss: float) -> dict[str, float]:
    """A multi-label model's evaluation values: :func:`multilabel_scores` of ``logits`` at probability 0.5
    (logit 0; AUC ranks the logits, not the float32 sigmoids, which saturate into ties), ``loss`` (the caller's
    mean loss), ``n`` and the ``count/thr/<i>/<bin>/pos|neg`` histograms of the probabilities
    (:func:`fedclinic.evaluation.thresholds.threshold_histogram`)."""
    z = np.asarray(logits, dtype=np.float64)
    return {"loss": float(loss), **multilabel_scores(truth, z, labels, threshold=0.0), "n": float(z.shape[0]),
            **threshold_histogram(truth, sigmoid(z))}


#: most evaluation values a site reports with a round's update (the aggregator accepts 256 per update)
ROUND_REPORT_KEYS = 200


def round_report_metrics(values: Mapping[str, float], *, max_keys: int = ROUND_REPORT_KEYS) -> dict[str, float]:
    """The evaluation values a site sends with a training round's update: without the ``count/`` histograms (they
    are for the final-model evaluation, whose transport takes thousands of keys), and without the per-label
    ``f1/`` and ``auc/`` keys when there would still be more than ``max_keys`` (a model with ~100 labels or more:
    the macro and micro figures stay), and without undefined (non-finite) values
    (:func:`fedclinic.evaluation.combine.defined_values`)."""
    out = {k: v for k, v in defined_values(values).items() if not k.startswith("count/")}
    if len(out) > max_keys:
        out = {k: v for k, v in out.items() if not k.startswith(("f1/", "auc/"))}
    return out


__all__ = ["ROUND_REPORT_KEYS", "midranks", "multilabel_evaluation", "multilabel_scores", "roc_auc",
           "round_report_metrics"]
