"""Read-outs of the round engine's state for the APIs: a task's status as the control API reports it, and the
model a task's latest round produced. Pure reads of the store; raise Refused(NOT_FOUND) for an unknown task."""

from __future__ import annotations

import grpc

from fedclinic.evaluation.combine import is_suppressed, suppress_cell
from fedclinic.training import safl
from fedclinic.errors import Refused
from fedclinic.proto import control_pb2

from aggregator_service.result_matrix import result_phase_status
from aggregator_service.round_metrics import site_evaluations, update_layers
from aggregator_service.store import Store, TaskRecord
from aggregator_service import distributed_dp

S = control_pb2
#: the task states a task never leaves
TERMINAL = (S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELLED)


def no_such_task(task_id: str) -> Refused:
    return Refused(grpc.StatusCode.NOT_FOUND,
                   f"no task {task_id!r} on this aggregator; list tasks with `fedclinic task list`")


def task_of(store: Store, task_id: str) -> TaskRecord:
    """The task, or Refused(NOT_FOUND)."""
    task = store.task(task_id)
    if task is None:
        raise no_such_task(task_id)
    return task


def latest_model_hash(store: Store, task_id: str) -> str:
    """The task's final model, else its newest aggregated round's; "" when no round has finished."""
    task = store.task(task_id)
    if task is None:
        return ""
    return task.final_model or store.newest_round_model(task_id)


def status_of(store: Store, task_id: str) -> control_pb2.TaskStatus:
    """The task as the control API reports it."""
    t = task_of(store, task_id)
    out = control_pb2.TaskStatus(task_id=t.task_id, spec=t.spec, state=t.state, current_round=t.current_round,
                                 error=t.error, owner=t.owner, created_unix_ms=t.created_ms,
                                 updated_unix_ms=t.updated_ms, initial_model_hash=t.initial_model,
                                 final_model_hash=t.final_model, signed=bool(store.signed_task(task_id)))
    phase = result_phase_status(store, task_id)
    if phase is not None:
        out.results.CopyFrom(phase)
        if phase.work == "statistics":  # the statistics view the SDK's table reads (fedclinic.evaluation.statistics)
            for cell in phase.cells:
                out.site_statistics[cell.site_id].values.update(cell.values)
            for pooled in phase.pooled:
                out.pooled_statistics.update(pooled.values)
    safl_task = t.spec.update.selection == safl.SAFL
    for r in store.rounds_of(task_id):
        assigned = store.assignments_of(task_id, r.round)
        fetched = {a.site: a for a in assigned}
        rs = control_pb2.RoundSummary(
            round=r.round, state=r.state, attempt=r.attempt, sites_target=r.sites_target,
            sites_assigned=[a.site for a in assigned if not a.declined],
            declined=[f"{a.site}: {a.declined}" for a in assigned if a.declined],
            metrics=r.metrics, uplink_bytes=r.uplink_bytes, downlink_bytes=r.downlink_bytes,
            opened_unix_ms=r.opened_ms, closed_unix_ms=r.closed_ms, deadline_unix_ms=r.deadline_ms,
            model_hash=r.model_hash, downlink_wire_bytes=sum(a.downlink_wire_bytes for a in assigned),
            eval_sites=int(r.metrics.get("eval_sites", 0)), eval_model_hash=r.base_model)
        distributed_dp.fill_summary(rs, t.spec)
        reported: set[str] = set()
        updates = store.updates_of(task_id, r.round)
        evals = {s: (suppress_cell(v, k), k) for s, (v, k) in site_evaluations(
            updates, store.results_of(task_id, r.round)).items()}
        for u in sorted(updates, key=lambda u: u.site):
            a = fetched.get(u.site)
            ev = evals.get(u.site, ({}, 0))[0]
            hidden = is_suppressed(ev)
            rs.reports.append(control_pb2.SiteReport(
                site_id=u.site, num_samples=u.num_samples, uplink_bytes=u.nbytes, metrics=u.metrics,
                eval_metrics={} if hidden else ev, eval_rows=0 if hidden else int(ev.get("eval_rows", 0)),
                eval_suppressed=hidden, uplink_fp32_bytes=u.fp32_bytes, uplink_wire_bytes=u.wire_bytes,
                selected_layers=update_layers(u.layout) if safl_task else [],
                downlink_bytes=a.downlink_bytes if a is not None else 0,
                downlink_wire_bytes=a.downlink_wire_bytes if a is not None else 0))
            reported.add(u.site)
        if r.state == control_pb2.ROUND_STATE_OPEN:
            rs.held.extend(f"{a.site}: {a.held}" for a in assigned if a.held and not a.declined
                           and a.site not in reported)
        out.rounds.append(rs)
    return out
