"""Combining sites' evaluation metrics: the one rule the aggregator and the simulator share.

Every site reports ``eval_rows`` (rows it evaluated) with its values (a flat ``name -> number``):

- a key starting with ``count/`` is a raw count and is **summed** over the pooled sites;
- ``eval_rows`` is summed too;
- every other key is the mean **weighted by** ``eval_rows`` over the pooled sites that carry it (finite values
  only): ``sum_s rows_s * v_s / sum_s rows_s``. A site that reports no ``eval_rows`` (an older agent) weighs 1.

Small cells: a site's cell with ``eval_rows < k`` (k = the site's ``min_cell_rows``, default
:data:`DEFAULT_MIN_CELL_ROWS`) is **suppressed**: only ``eval_rows_suppressed = 1`` is kept for it, and it counts
in nothing pooled. The rule implemented: a pool is over the unsuppressed cells only, and is published when at
least :data:`MIN_POOLED_SITES` (1) of them are left. A suppressed cell never enters any pool, so no pool differs
from another by a small cell and none can be derived by difference; a pool over one unsuppressed cell equals
that cell, which is shown anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

#: k when a site does not say: cells of fewer evaluated rows are suppressed
DEFAULT_MIN_CELL_ROWS = 10
#: fewest unsuppressed sites a pool is published over
MIN_POOLED_SITES = 1
ROWS = "eval_rows"
SUPPRESSED = "eval_rows_suppressed"
COUNT_PREFIX = "count/"


def suppress_cell(values: Mapping[str, float], min_cell: int = DEFAULT_MIN_CELL_ROWS) -> dict[str, float]:
    """The cell as it may be shown: ``values`` unchanged when ``eval_rows >= min_cell`` (a cell without
    ``eval_rows`` is not an evaluation and is kept), else only ``{eval_rows_suppressed: 1}``."""
    k = min_cell if min_cell > 0 else DEFAULT_MIN_CELL_ROWS
    if ROWS in values and not values[ROWS] >= k:
        return {SUPPRESSED: 1.0}
    return dict(values)


def is_suppressed(values: Mapping[str, float]) -> bool:
    return values.get(SUPPRESSED, 0.0) == 1.0 and ROWS not in values


def weighted_metrics(per_site: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The combination rule of the module docstring over every site given (no suppression, no floor): counts and
    ``eval_rows`` summed, other keys weighted by ``eval_rows``."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    sums: dict[str, float] = {}
    for values in per_site.values():
        rows = values.get(ROWS, 1.0)
        w = rows if math.isfinite(rows) and rows > 0 else 0.0
        for k, v in values.items():
            if not math.isfinite(v):
                continue
            if k == ROWS or k.startswith(COUNT_PREFIX):
                sums[k] = sums.get(k, 0.0) + v
            elif k != SUPPRESSED:
                totals[k] = totals.get(k, 0.0) + w * v
                weights[k] = weights.get(k, 0.0) + w
    out = {k: totals[k] / weights[k] for k in totals if weights[k] > 0}
    out.update(sums)
    return out


@dataclass
class Pooled:
    """A pool over sites: ``values`` (empty when it may not be published), how many ``sites`` are in it, and a
    ``note`` saying why not when empty."""

    values: dict[str, float] = field(default_factory=dict)
    sites: int = 0
    note: str = ""


def pool_evaluations(per_site: Mapping[str, Mapping[str, float]], min_cell: Mapping[str, int] | int | None = None,
                     *, min_sites: int = MIN_POOLED_SITES) -> Pooled:
    """Pool the sites' cells of one model (module docstring): suppressed cells (already, or by ``min_cell``: a
    site -> k mapping or one k for all) are left out; nothing is published over fewer than ``min_sites``
    unsuppressed sites."""
    kept = {}
    for site, values in per_site.items():
        k = (min_cell.get(site, DEFAULT_MIN_CELL_ROWS) if isinstance(min_cell, Mapping)
             else (min_cell or DEFAULT_MIN_CELL_ROWS))
        cell = suppress_cell(values, k)
        if not is_suppressed(cell):
            kept[site] = cell
    if len(kept) < max(min_sites, 1):
        return Pooled({}, len(kept), f"not pooled: {len(kept)} site(s) with enough evaluated rows, "
                                     f"{max(min_sites, 1)} needed (small cells are suppressed)")
    return Pooled(weighted_metrics(kept), len(kept))


def defined_values(values: Mapping[str, float]) -> dict[str, float]:
    """The values of an evaluation that a site can report: the finite ones, as floats. An undefined figure (NaN,
    e.g. the ROC AUC of a label that has one class only in the site's rows) is left out rather than sent: the
    aggregator refuses non-finite numbers, and the pooled mean of that key is over the sites where it is
    defined (module docstring)."""
    return {k: float(v) for k, v in values.items() if math.isfinite(float(v))}


__all__ = ["DEFAULT_MIN_CELL_ROWS", "MIN_POOLED_SITES", "Pooled", "defined_values", "is_suppressed",
           "pool_evaluations", "suppress_cell", "weighted_metrics"]
