"""Differentially private statistics: a site's counts released with discrete Laplace noise.

Neighbouring datasets differ by adding or removing one row (valid, missing or invalid). The released values are
integer count vectors, each a *group* of known L1 sensitivity ``Delta``, plus what is computed from them
(post-processing, which costs no privacy). A task's ``[statistics] epsilon`` is split evenly over the groups that
are released (``epsilon_g = epsilon / G``, basic composition) and each count of group g gets independent discrete
Laplace noise of scale ``Delta_g / epsilon_g`` (:class:`fedclinic.strategies.secure_laplace.SecureDiscreteLaplace`,
the CSPRNG of :mod:`fedclinic.strategies.secure_random`), so the whole answer is ``epsilon``-DP (delta 0):

=====================  ======================================================  =================================
group                  counts                                                  Delta (one row changes at most)
=====================  ======================================================  =================================
rows                   ``rows``, ``missing_rows``, ``invalid_rows``            1 (a row is in exactly one class)
labels                 ``label/*`` (and ``label_pair/*``, multi-label)         1 single-label; L (NER rows: one
                                                                               per entity type); L + L(L-1)/2
                                                                               multi-label (L labels)
char lengths           a histogram of row lengths in characters over           1 (one bin)
                       :data:`LENGTH_EDGES` (quantiles ``chars_q*``)
token lengths          the same of lengths in tokens (``tokens_q*``)           1
truncation             ``count/truncated_rows``                                1
coverage               ``count/tokens``, ``count/unk_tokens``,                 2T + 16T, T = max_length
                       ``count/chars`` with each row clipped to T tokens,
                       T unknown tokens, 16 T characters
=====================  ======================================================  =================================

The last three are released only with a tokenizer. **Per patient**: when one privacy unit (a patient) may hold up
to m rows (``rows_per_unit``, from the site's patient id column), every sensitivity is multiplied by m (group
privacy: m rows change each count vector by at most m times what one row does), so the answer protects patients. Noisy counts are rounded to integers by the mechanism itself and
clipped at 0; the quantiles come from the noisy histogram (linear within a bin: log-spaced bins, 4 per doubling,
so a quantile is within about 19 % of the length it estimates, plus the noise: the running sum over ~60 bins
carries noise of about sqrt(2 * 60) * 6 / epsilon rows at the top, so a site needs some hundreds of rows for
useful quantiles at epsilon 1), the rates from the noisy sums
(:func:`fedclinic.evaluation.statistics_counts.add_rates`). The histograms themselves are not released. Clipping
the coverage sums per row is what bounds their sensitivity: a row longer than T tokens or 16 T characters counts
as that long there (the exact release does not clip).
"""

from __future__ import annotations

import numpy as np

from fedclinic.evaluation.statistics_counts import (
    QUANTILES,
    SiteCounts,
    add_rates,
    label_keys,
    quantile_keys,
)
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace

#: lower edges of the length histogram bins (characters or tokens): 0, 1, 2, 3, 4, 5, 6, 8, 9, 11, 13, 16, ...,
#: 2^17; 4 bins per doubling; the last bin (2^17 = 131072 and longer) is open
LENGTH_EDGES = np.concatenate([[0], np.unique(np.floor(2.0 ** (np.arange(0, 69) / 4.0)).astype(np.int64))])
#: a row's characters in the coverage sums are clipped to this many per token of max_length
CHARS_PER_TOKEN_CLIP = 16


def label_sensitivity(labels_per_row: int, pairs: bool) -> int:
    """The L1 sensitivity of the label group: how many label (and, with ``pairs``, label-pair) counts one row can
    change, when it carries at most ``labels_per_row`` labels."""
    m = labels_per_row
    return m + (m * (m - 1) // 2 if pairs else 0)


def noisy_release(counts: SiteCounts, epsilon: float, sampler: SecureDiscreteLaplace | None = None, *,
                  rows_per_unit: int = 1) -> dict[str, float]:
    """The values of ``counts`` under ``epsilon``-DP (see the module docstring), before suppression; with
    ``rows_per_unit`` = m the unit is a group of up to m rows (a patient)."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if rows_per_unit < 1:
        raise ValueError(f"rows_per_unit must be >= 1, got {rows_per_unit}")
    sampler = sampler or SecureDiscreteLaplace()
    labels = list(counts.labels_in_order)
    keys = label_keys(labels, counts.multi_label)
    label_values = [counts.labels[lab] for lab in labels] + [counts.pairs[p] for p in counts.pairs]
    groups: list[tuple[list[str], np.ndarray, int]] = [
        (["rows", "missing_rows", "invalid_rows"], np.array([counts.rows, counts.missing, counts.invalid]), 1),
        (keys, np.array(label_values, np.int64), label_sensitivity(counts.labels_per_row, bool(counts.pairs))),
        (["hist/chars"], histogram(counts.chars), 1),
    ]
    if counts.tokens is not None:
        t = counts.max_length
        clipped = [np.minimum(counts.content, t).sum(), np.minimum(counts.unk, t).sum(),
                   np.minimum(counts.chars, CHARS_PER_TOKEN_CLIP * t).sum()]
        groups += [(["hist/tokens"], histogram(counts.tokens), 1),
                   (["count/truncated_rows"], np.array([int((counts.tokens > t).sum())]), 1),
                   (["count/tokens", "count/unk_tokens", "count/chars"], np.array(clipped, np.int64),
                    (2 + CHARS_PER_TOKEN_CLIP) * t)]
    eps_group = epsilon / len(groups)
    out: dict[str, float] = {}
    for names, true, delta in groups:
        noisy = true.astype(np.int64) + sampler.sample(len(true), rows_per_unit * delta / eps_group)
        if names[0].startswith("hist/"):
            if noisy.sum() > 0:
                out.update(zip(quantile_keys(names[0][len("hist/"):]), histogram_quantiles(noisy)))
        else:
            out.update({k: float(max(v, 0)) for k, v in zip(names, noisy)})
    add_rates(out)
    return out


def histogram(lengths: np.ndarray) -> np.ndarray:
    """Counts of ``lengths`` in the bins of :data:`LENGTH_EDGES`."""
    idx = np.searchsorted(LENGTH_EDGES, np.asarray(lengths, np.int64), side="right") - 1
    return np.bincount(idx, minlength=len(LENGTH_EDGES)).astype(np.int64)


def histogram_quantiles(counts: np.ndarray) -> list[float]:
    """The :data:`~fedclinic.evaluation.statistics_counts.QUANTILES` of a (noisy) histogram over
    :data:`LENGTH_EDGES`, linear within a bin (the open last bin gives its lower edge). Noisy bins are summed
    unclipped (the noise of the many empty bins then cancels on average instead of piling up), the running sum
    made non-decreasing and non-negative."""
    cum = np.maximum.accumulate(np.maximum(np.cumsum(np.asarray(counts, np.float64)), 0.0))
    total = cum[-1]
    out = []
    for pp in QUANTILES:
        target = pp / 100.0 * total
        i = min(int(np.searchsorted(cum, target, side="left")), len(cum) - 1)
        lo = float(LENGTH_EDGES[i])
        before = cum[i - 1] if i > 0 else 0.0
        mass = cum[i] - before
        if i + 1 >= len(LENGTH_EDGES) or mass <= 0:
            out.append(lo)
            continue
        out.append(float(lo + (target - before) / mass * float(LENGTH_EDGES[i + 1] - LENGTH_EDGES[i])))
    return out


__all__ = ["CHARS_PER_TOKEN_CLIP", "LENGTH_EDGES", "histogram", "histogram_quantiles", "label_sensitivity",
           "noisy_release"]
