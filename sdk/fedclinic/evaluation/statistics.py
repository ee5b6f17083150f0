"""Federated statistics: what one site releases about its dataset, and the pool over sites.

A site answers a statistics task with :func:`site_statistics` (the hospital agent through
``hospital_agent.site_statistics.answer_statistics``); whoever holds several sites' answers pools them with
:func:`pool_statistics`. Values are flat ``dict[str, float]`` with these keys (per site and pooled):

==================================  ===========================================================================
``rows``                            valid rows (a text and labels from the task's label set); the rows below
                                    describe these only
``missing_rows``, ``invalid_rows``  rows without text or label / rows the reader refuses otherwise (unparsable,
                                    unknown label, ...; :mod:`fedclinic.evaluation.statistics_counts`)
``label/<label>``                   rows carrying the label (``label/#<i>`` for a name that is not printable ASCII)
``label_pair/<a>|<b>``              multi-label: rows carrying both (``a`` before ``b`` in label order); not
                                    for more than 90 labels (the transport's key limit)
``chars_q<PP>``, ``tokens_q<PP>``   text length quantiles, PP in 05 25 50 75 95; in characters, and in tokens
                                    with the special tokens, as the model reads it
``truncated_rate``                  share of rows longer than the task's max_length tokens
``unk_rate``                        share of the content tokens that are the tokenizer's unknown token
``tokens_per_char``                 content tokens per character
``count/truncated_rows``,           the sums behind the rates (summed by a pool)
``count/tokens``,
``count/unk_tokens``, ``count/chars``
``suppressed/<key>`` = 1            the cell ``<key>`` is withheld (small-cell rule below); the key is absent
``partial/<key>`` = n               pooled only: n sites withheld ``<key>``; the pooled value leaves them out
``sites``                           pooled only: the sites whose ``rows`` the pool holds
``min_cell_rows``                   the k of the small-cell rule the values were released under
==================================  ===========================================================================

The token keys need the task's tokenizer; without one they are absent. A site without valid rows reports
``rows`` = 0, its label counts 0 and no quantiles or rates.

**Small-cell suppression** (k = ``min_cell``, the site's ``min_cell_rows``): a count of rows ``c`` with
``0 < c < k`` is withheld. (1) A site with ``0 < rows < k`` withholds everything about its rows (all keys but
``missing_rows`` and ``invalid_rows``): quantiles and rates of a group under k rows are never shown.
(2) ``missing_rows`` and ``invalid_rows`` alone; ``count/truncated_rows`` with ``truncated_rate`` when the
truncated rows or the untruncated ones (``rows`` minus them) are 1 to k-1. (3) The label table -- ``label/*`` with, multi-label, ``label_pair/*`` -- is one group,
because its cells add up to published totals (single-label: the labels sum to ``rows``; two labels a, b
multi-label: ``rows = a + b - ab``). *Complementary suppression*: when a cell of the group is withheld, further
cells are withheld, the smallest non-zero ones first, until at least two are withheld **and** together they hold
at least k rows; so no published total minus the published cells pins down a withheld cell (it gives only the sum
of two or more withheld cells, itself at least k). Zero counts are published (a label a site lacks is a finding),
unless complementary suppression needs them.

**Pooling** uses only what the sites published, so a pool reveals nothing that the sites' published values do not
(it is post-processing of them): a pooled count is the sum over the sites that published it, and ``partial/<key>``
says how many sites withheld it (its true total is larger by less than k per such site). Pooled rates are ratios
of pooled sums (over the sites that published both parts: exact). Pooled quantiles are **row-weighted means of the
sites' quantiles** -- an approximation, exact when the sites share a length distribution; the sites do not release
the histograms an exact pooled quantile would need. A pooled count ``0 < c < k`` (possible with noise or partial
sums) is withheld too.

**Noise** (optional): with ``[statistics] epsilon`` in the task (``spec.statistics.epsilon`` > 0) the site
releases its counts under epsilon-differential privacy with discrete Laplace noise
(:mod:`fedclinic.evaluation.statistics_dp`, which states the mechanism and the sensitivities); suppression then
applies to the noisy counts. Charging the epsilon to the site's privacy ledger is the agent's job
(``answer_statistics``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from fedclinic.evaluation.statistics_counts import (
    QUANTILES,
    SUM_KEYS,
    RowProblems,
    SiteCounts,
    add_rates,
    label_keys,
    measure,
    quantile_keys,
)
from fedclinic.evaluation.statistics_dp import noisy_release
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace

#: keys a pool sums (with the label table)
_SUMMED = ("rows", "missing_rows", "invalid_rows", *SUM_KEYS)
SUPPRESSED = "suppressed/"
PARTIAL = "partial/"


def site_statistics(examples: Sequence[Any], tokenizer: Any, spec: Any, *, min_cell: int,
                    problems: RowProblems | None = None, sampler: SecureDiscreteLaplace | None = None,
                    rows_per_unit: int = 1) -> dict[str, float]:
    """One site's released statistics (the keys above) of ``examples`` for the task ``spec`` (a ``TaskSpec``, or
    a ``Task``: its labels, ``multi_label``, ``training.max_length`` and ``statistics.epsilon``), small cells withheld with
    ``min_cell`` = k. ``tokenizer``: the task's (``tokenizers.Tokenizer`` or a ``transformers`` fast tokenizer), or
    None to leave out the token keys. ``problems``: the rows the reader skipped (its ``on_bad_row``). With
    ``spec.statistics.epsilon`` > 0 the counts carry discrete Laplace noise from ``sampler`` (a fresh CSPRNG one
    when None; a test passes a replayable one), for a privacy unit of up to ``rows_per_unit`` rows (1: a row; a
    patient's most rows to protect patients)."""
    if min_cell < 1:
        raise ValueError(f"min_cell must be >= 1, got {min_cell}")
    if hasattr(spec, "to_spec"):  # a fedclinic.spec.task.Task (the simulator, a notebook): its validated spec
        spec = spec.to_spec()
    counts = measure(examples, tokenizer, list(spec.labels), multi_label=bool(spec.multi_label),
                     max_length=int(spec.training.max_length), problems=problems)
    epsilon = float(spec.statistics.epsilon) if spec.HasField("statistics") else 0.0
    values = (noisy_release(counts, epsilon, sampler, rows_per_unit=rows_per_unit) if epsilon > 0
              else exact_release(counts))
    out = suppress_site(values, labels=counts.labels_in_order, multi_label=counts.multi_label, min_cell=min_cell)
    out["min_cell_rows"] = float(min_cell)
    return out


def exact_release(counts: SiteCounts) -> dict[str, float]:
    """The exact values of ``counts`` (before suppression): counts, exact quantiles (linear interpolation between
    order statistics), the sums and the rates."""
    labels = list(counts.labels_in_order)
    out: dict[str, float] = {"rows": float(counts.rows), "missing_rows": float(counts.missing),
                             "invalid_rows": float(counts.invalid)}
    cells = [counts.labels[lab] for lab in labels] + [counts.pairs[p] for p in counts.pairs]
    out.update({k: float(v) for k, v in zip(label_keys(labels, counts.multi_label), cells)})
    if counts.rows:
        out.update(zip(quantile_keys("chars"), _quantiles(counts.chars)))
    if counts.tokens is not None:
        if counts.rows:
            out.update(zip(quantile_keys("tokens"), _quantiles(counts.tokens)))
        out["count/truncated_rows"] = float((counts.tokens > counts.max_length).sum())
        out["count/tokens"] = float(counts.content.sum())
        out["count/unk_tokens"] = float(counts.unk.sum())
        out["count/chars"] = float(counts.chars.sum())
    add_rates(out)
    return out


def _quantiles(lengths: np.ndarray) -> list[float]:
    return [float(q) for q in np.percentile(lengths, QUANTILES, method="linear")]


def suppress_site(values: Mapping[str, float], *, labels: Sequence[str], multi_label: bool,
                  min_cell: int) -> dict[str, float]:
    """``values`` with the small-cell rule applied (module docstring): each withheld key is removed and listed
    as ``suppressed/<key>`` = 1."""
    out = dict(values)
    k = min_cell
    hidden: list[str] = []

    def small(key: str) -> bool:
        return key in out and 0 < out[key] < k

    rows = out.get("rows", 0.0)
    if 0 < rows < k:
        hidden = [key for key in out if key not in ("missing_rows", "invalid_rows")]
    else:
        table = [key for key in label_keys(labels, multi_label) if key in out]
        hidden = _complementary([key for key in table if small(key)], table, out, k)
        truncated = out.get("count/truncated_rows")
        if truncated is not None and (0 < truncated < k or 0 < rows - truncated < k):  # its complement too
            hidden += ["count/truncated_rows", "truncated_rate"]
    hidden += [key for key in ("missing_rows", "invalid_rows") if small(key)]
    return _withhold(out, hidden)


def _complementary(primary: list[str], table: list[str], values: Mapping[str, float], k: int) -> list[str]:
    """``primary`` plus the cells of ``table`` complementary suppression adds: the smallest non-zero published
    ones first (then zeros), until at least two cells are withheld and they hold at least k rows together."""
    hidden = list(primary)
    if not hidden:
        return hidden
    rest = sorted((key for key in table if key not in hidden), key=lambda key: (values[key] == 0, values[key]))
    while rest and (len(hidden) < 2 or sum(values[key] for key in hidden) < k):
        hidden.append(rest.pop(0))
    return hidden


def _withhold(values: dict[str, float], hidden: Sequence[str]) -> dict[str, float]:
    for key in hidden:
        if key in values:
            del values[key]
            values[SUPPRESSED + key] = 1.0
    return values


def pool_statistics(per_site: Mapping[str, Mapping[str, float]], *, min_cell: int) -> dict[str, float]:
    """The pool of several sites' released values (module docstring): sums of the published counts with
    ``partial/<key>``, rates from pooled sums, row-weighted quantiles, ``sites``; pooled counts ``0 < c <
    min_cell`` withheld."""
    sites = list(per_site.values())
    count_keys = sorted({key for v in sites for key in _keys(v) if _is_count(key)})
    out: dict[str, float] = {"sites": float(sum(1 for v in sites if "rows" in v)), "min_cell_rows": float(min_cell)}
    for key in count_keys:
        published = [v[key] for v in sites if key in v]
        left = sum(1 for v in sites if SUPPRESSED + key in v)
        if published:
            out[key] = float(sum(published))
        elif left:
            out[SUPPRESSED + key] = 1.0
        if left and published:
            out[PARTIAL + key] = float(left)
    for num, den, name, clip in (("count/truncated_rows", "rows", "truncated_rate", True),
                                 ("count/unk_tokens", "count/tokens", "unk_rate", True),
                                 ("count/tokens", "count/chars", "tokens_per_char", False)):
        both = [v for v in sites if num in v and den in v]
        total = sum(v[den] for v in both)
        if both and total > 0:
            r = max(0.0, sum(v[num] for v in both) / total)
            out[name] = min(1.0, r) if clip else r
    for key in quantile_keys("chars") + quantile_keys("tokens"):
        both = [v for v in sites if key in v and v.get("rows", 0) > 0]
        weight = sum(v["rows"] for v in both)
        if weight > 0:
            out[key] = sum(v["rows"] * v[key] for v in both) / weight
    hidden = [key for key in count_keys if key in out and 0 < out[key] < min_cell]
    if "count/truncated_rows" in hidden:
        hidden.append("truncated_rate")
    return _withhold(out, hidden)


def _keys(values: Mapping[str, float]) -> set[str]:
    """The keys a site's values speak of, published or withheld."""
    return {key[len(SUPPRESSED):] if key.startswith(SUPPRESSED) else key for key in values}


def _is_count(key: str) -> bool:
    return key in _SUMMED or key.startswith(("label/", "label_pair/"))


__all__ = ["PARTIAL", "SUPPRESSED", "RowProblems", "exact_release", "pool_statistics",
           "site_statistics", "suppress_site"]
