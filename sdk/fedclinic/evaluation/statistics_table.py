"""What the scientist sees of federated statistics: a table (sites as columns, the pool last) and warnings.

:func:`statistics_table` renders the values of :mod:`fedclinic.evaluation.statistics` (labels as rows, sites as
columns): a withheld cell reads ``<k`` (k: the site's ``min_cell_rows``, reported with its values), a pooled count
that leaves out some sites' withheld cells ``>=n``, a key a site did not report ``-``.
:func:`statistics_warnings` lists what a scientist should act on before training: a label a site lacks (0 rows,
published, not withheld) and a tokenizer that does not cover a site's text (``unk_rate`` above 5 %).
:func:`coverage_warning` is the same tokenizer warning for the rate a site reports when it accepts a training
task (``tokenizer_unk_rate``, shown by ``fedclinic task watch``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fedclinic.evaluation.statistics import pool_statistics
from fedclinic.evaluation.statistics_counts import QUANTILES, label_key, pair_key

#: a site whose share of unknown tokens is above this gets a warning
UNK_WARNING_RATE = 0.05
#: the k shown for a withheld cell of a site that did not report its ``min_cell_rows``
DEFAULT_MIN_CELL = 10
POOLED = "pooled"

_COUNT_ROWS = (("rows", "rows"), ("missing_rows", "missing rows"), ("invalid_rows", "invalid rows"))
_TAIL_ROWS = tuple((f"{unit}_q{pp:02d}", f"{unit} p{pp:02d}") for unit in ("chars", "tokens") for pp in QUANTILES) + (
    ("truncated_rate", "truncated"), ("unk_rate", "[UNK] rate"), ("tokens_per_char", "tokens/char"))
_RATES = ("truncated_rate", "unk_rate")


def statistics_table(per_site: Mapping[str, Mapping[str, float]], pooled: Mapping[str, float] | None,
                     labels: Sequence[str], *, multi_label: bool = False) -> str:
    """The table as text: one column per site (sorted by name) and ``pooled`` last (when given); rows: row
    counts, one row per label (and, multi-label, per label pair that any site reports), length quantiles, rates."""
    columns = sorted(per_site)
    values = [per_site[s] for s in columns]
    if pooled is not None:
        columns.append(POOLED)
        values.append(pooled)
    rows: list[tuple[str, str]] = list(_COUNT_ROWS)
    rows += [(label_key(lab, i), f"label {lab}") for i, lab in enumerate(labels)]
    if multi_label:
        pairs = [(pair_key(a, i, b, j), f"both {a} & {b}") for i, a in enumerate(labels)
                 for j, b in enumerate(labels) if i < j]
        rows += [(key, name) for key, name in pairs if any(key in v or f"suppressed/{key}" in v for v in values)]
    rows += [(key, name) for key, name in _TAIL_ROWS if any(key in v or f"suppressed/{key}" in v for v in values)]
    cells = [[name] + [_cell(v, key) for v in values] for key, name in rows]
    header = [""] + columns
    widths = [max(len(r[i]) for r in [header] + cells) for i in range(len(header))]
    lines = [_line(header, widths)] + [_line(r, widths) for r in cells]
    return "\n".join(lines)


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]).rstrip()


def _cell(values: Mapping[str, float], key: str) -> str:
    if f"suppressed/{key}" in values:
        return f"<{int(values.get('min_cell_rows', DEFAULT_MIN_CELL))}"
    if key not in values:
        return "-"
    v = float(values[key])
    if key in _RATES:
        text = f"{100 * v:.1f}%"
    elif key == "tokens_per_char":
        text = f"{v:.3f}"
    elif "_q" in key:
        text = f"{v:.0f}" if v >= 100 else f"{v:.1f}"
    else:
        text = f"{v:.0f}"
    return f">={text}" if f"partial/{key}" in values else text


def coverage_warning(site: str, unk_rate: float) -> str | None:
    """The warning for a site whose text the tokenizer does not cover (``unk_rate`` above 5 %), else None."""
    if not unk_rate > UNK_WARNING_RATE:
        return None
    return (f"site {site}: {100 * unk_rate:.1f}% of its tokens are the tokenizer's unknown token (above "
            f"{100 * UNK_WARNING_RATE:.0f}%): the tokenizer does not cover its text (another language or script?); "
            "the model learns little from it. Choose a tokenizer (model) that covers it, or check the site's data")


def statistics_warnings(per_site: Mapping[str, Mapping[str, float]], pooled: Mapping[str, float] | None,
                        labels: Sequence[str]) -> list[str]:
    """Warnings, site by site (sorted): a label the site lacks (its count published as 0), and an ``unk_rate``
    above 5 %; then a label no site has (from the pool). A withheld cell never warns (it is 1..k-1 rows)."""
    out = []
    for site in sorted(per_site):
        v = per_site[site]
        lacking = [lab for i, lab in enumerate(labels) if v.get(label_key(lab, i)) == 0]
        if lacking and v.get("rows", 0) > 0:
            out.append(f"site {site} has no rows labelled {', '.join(repr(x) for x in lacking)}: the federated "
                       "model learns these labels from the other sites only, and the site's evaluation cannot "
                       "score them")
        if "unk_rate" in v:
            warning = coverage_warning(site, float(v["unk_rate"]))
            if warning:
                out.append(warning)
    if pooled is not None:
        absent = [lab for i, lab in enumerate(labels) if pooled.get(label_key(lab, i)) == 0
                  and f"partial/{label_key(lab, i)}" not in pooled]
        if absent:
            out.append(f"no site has rows labelled {', '.join(repr(x) for x in absent)}: no model can learn them; "
                       "remove them from the task's labels or find data")
    return out


def statistics_report(per_site: Mapping[str, Mapping[str, float]], pooled: Mapping[str, float] | None,
                      labels: Sequence[str], *, multi_label: bool = False, indent: str = "  ") -> str:
    """The table and its warnings as one block (``fedclinic task status`` of a statistics task). Without
    ``pooled`` (an aggregator that sends none) the pool is computed here from the sites' values, with the
    largest k any site reported."""
    if not pooled and per_site:
        k = max(int(v.get("min_cell_rows", DEFAULT_MIN_CELL)) for v in per_site.values())
        pooled = pool_statistics(per_site, min_cell=k)
    lines = statistics_table(per_site, pooled, labels, multi_label=multi_label).splitlines()
    lines += [f"warning: {w}" for w in statistics_warnings(per_site, pooled, labels)]
    return "\n".join(indent + line for line in lines)


__all__ = ["DEFAULT_MIN_CELL", "POOLED", "UNK_WARNING_RATE", "coverage_warning", "statistics_report",
           "statistics_table", "statistics_warnings"]
