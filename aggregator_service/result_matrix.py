"""Read-out of a task's result phase: the site x model matrix and the pooled values (TaskStatus.results).

Each cell is a site's values for one model as the site sent them, except that an evaluation cell with fewer
evaluated rows than the site's ``min_cell_rows`` is **suppressed** (no values, ``suppressed`` set;
fedclinic.evaluation.combine.suppress_cell). Pooled per model: an evaluation by
fedclinic.evaluation.combine.pool_evaluations (counts summed, the rest weighted by ``eval_rows``, suppressed cells
left out); statistics by fedclinic.evaluation.statistics.pool_statistics (the sites suppressed their own small
cells before sending). Also: which sites declined the work and which have not answered. Pure reads of the store.
"""

from __future__ import annotations

from fedclinic.evaluation.combine import is_suppressed, pool_evaluations, suppress_cell
from fedclinic.proto import control_pb2

from aggregator_service.store import Store

STATISTICS = "statistics"


def result_phase_status(store: Store, task_id: str) -> control_pb2.ResultPhase | None:
    """The task's result phase as TaskStatus.results shows it; None when it has none."""
    phase = store.result_phase(task_id)
    if phase is None:
        return None
    out = control_pb2.ResultPhase(work=phase.work, round=phase.round, open=not phase.closed_ms,
                                  model_hash=phase.model_hash, opened_unix_ms=phase.opened_ms,
                                  deadline_unix_ms=phase.deadline_ms, closed_unix_ms=phase.closed_ms)
    results = store.results_of(task_id, phase.round)
    by_model: dict[str, dict[str, dict[str, float]]] = {}
    k_of: dict[str, int] = {}
    for r in results:
        k_of[r.site] = r.min_cell
        by_model.setdefault(r.model, {})[r.site] = r.values
        if phase.work == STATISTICS:
            cell = dict(r.values)
            suppressed = cell.get("suppressed/rows", 0.0) == 1.0
        else:
            cell = suppress_cell(r.values, r.min_cell)
            suppressed = is_suppressed(cell)
        shown = cell if phase.work == STATISTICS or not suppressed else {}  # a site suppressed its own statistics
        out.cells.append(control_pb2.ResultCell(site_id=r.site, model=r.model, suppressed=suppressed, values=shown,
                                                rows=0 if suppressed else int(cell.get("eval_rows", 0))))
    for model, per_site in sorted(by_model.items()):
        if phase.work == STATISTICS:
            out.pooled.append(_pooled_statistics(model, per_site, max(k_of.values(), default=0)))
            continue
        pooled = pool_evaluations(per_site, k_of)
        out.pooled.append(control_pb2.PooledResult(model=model, values=pooled.values, sites=pooled.sites,
                                                   note=pooled.note))
    answered = {r.site for r in results}
    for a in store.assignments_of(task_id, phase.round):
        if a.declined:
            out.declined.append(f"{a.site}: {a.declined}")
        elif a.site not in answered and not phase.closed_ms:
            out.waiting.append(f"{a.site} (held: {a.held})" if a.held else a.site)
    return out


def _pooled_statistics(model: str, per_site: dict[str, dict[str, float]], min_cell: int) -> control_pb2.PooledResult:
    """Statistics pooled by the stats module's own rule (its keys are its own to combine)."""
    try:  # numpy only; present in every build that has the statistics module
        from fedclinic.evaluation.statistics import pool_statistics
    except ImportError:
        return control_pb2.PooledResult(model=model, sites=len(per_site),
                                        note="this aggregator build cannot pool statistics")
    values = pool_statistics(per_site, min_cell=min_cell or 10)
    return control_pb2.PooledResult(model=model, values=values, sites=len(per_site))
