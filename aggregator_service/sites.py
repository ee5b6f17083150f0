"""Sites: which agents are connected, what they announced, and the work each is given.

:class:`Sites` keeps the connection table (work streams per site) and the update codecs each site announced
at Hello, decides whether a site may take a task (:meth:`Sites.eligible`: named in the task, secure-aggregation
capable when needed, has the task's codecs, has not declined it for good), hands out assignments on the work
stream (:meth:`Sites.next_work`: at most ``sites_target`` active per round attempt, never twice per attempt,
cancellations of ended tasks; a round declined for now is offered again at its next attempt) and records holds
and declines. Callers hold the engine's lock; every change is written through the store, so nothing here
survives a restart except what the store holds.
"""

from __future__ import annotations

from typing import Callable, Iterable

import grpc
import structlog

from fedclinic.transport import codec_wire
from fedclinic.errors import ConfigError, Refused
from fedclinic.proto import agent_pb2, control_pb2, task_pb2
from fedclinic.transport.wire import manifest_to_proto

from aggregator_service.store import Store, now_ms
from aggregator_service.update_admission import sent_tensors

log = structlog.get_logger("fedclinic.aggregator.engine")

S = control_pb2


class Sites:
    """The connection table and the assignment of work to sites (module docstring)."""

    def __init__(self, store: Store, secagg_capable: Callable[[str], bool]) -> None:
        self.store = store
        self._secagg_capable = secagg_capable
        self._connected: dict[str, int] = {}
        #: update codecs each site announced at Hello (a site that did not say Hello takes raw tasks only)
        self._codecs: dict[str, frozenset[str]] = {}

    # connections and capabilities ------------------------------------------------------------------------
    def hello_codecs(self, site: str, codecs: Iterable[str]) -> None:
        """Remember the update codecs ``site`` announced at Hello (``Capabilities.codecs``)."""
        self._codecs[site] = frozenset(codecs)

    def supports_codec(self, site: str, codec: str) -> bool:
        """Can ``site`` encode updates with the task codec ``codec`` (raw: every site)?"""
        try:
            needed = codec_wire.needed_codecs(codec)
        except ConfigError:
            return False
        return set(needed) <= self._codecs.get(site, frozenset())

    def connected(self, site: str) -> None:
        self._connected[site] = self._connected.get(site, 0) + 1

    def disconnected(self, site: str) -> None:
        n = self._connected.get(site, 0) - 1
        if n <= 0:
            self._connected.pop(site, None)
        else:
            self._connected[site] = n

    def connected_sites(self) -> list[str]:
        """The sites with a work stream open now."""
        return list(self._connected)

    def eligible(self, task_id: str, spec: task_pb2.TaskSpec, site: str) -> bool:
        """May ``site`` be assigned rounds of the task (module docstring)?"""
        if spec.sites and site not in spec.sites:
            return False
        if spec.secure_aggregation.enabled and not self._secagg_capable(site):
            return False  # the agent did not announce "secagg-v2" (signed secure-aggregation keys) at Hello
        if not self.supports_codec(site, spec.update.codec):
            return False  # the agent did not announce every codec the task's updates use
        return not self.store.declined_for_good(task_id, site)

    def eligible_connected(self, task_id: str, spec: task_pb2.TaskSpec) -> list[str]:
        return [s for s in self._connected if self.eligible(task_id, spec, s)]

    # work ----------------------------------------------------------------------------------------------
    def next_work(self, site: str, delivered: dict[tuple[str, int, int], bool]) -> list[agent_pb2.WorkItem]:
        """Work for ``site`` not yet delivered on this stream (``delivered``: (task, round, attempt) keys, kept
        by the stream): new assignments, and cancellations of delivered tasks that ended."""
        items: list[agent_pb2.WorkItem] = []
        for key in list(delivered):
            task = self.store.task(key[0])
            rnd = self.store.round(key[0], key[1])
            if task is not None and task.state in (S.TASK_STATE_CANCELLED, S.TASK_STATE_FAILED):
                items.append(agent_pb2.WorkItem(cancel=agent_pb2.CancelWork(task_id=key[0], reason=task.error)))
                del delivered[key]
            elif key[2] and (rnd is None or rnd.state != S.ROUND_STATE_OPEN):  # attempt 0: a result phase's
                del delivered[key]                                             # (aggregator_service.results)
        for task in self.store.tasks(S.TASK_STATE_RUNNING):
            spec = task.spec
            rnd = self.store.open_round_of(task.task_id)
            if rnd is None or not self.eligible(task.task_id, spec, site):
                continue
            if (task.task_id, rnd.round, rnd.attempt) in delivered:
                continue
            if self.store.has_update(task.task_id, rnd.round, site):
                continue
            a = self.store.assignment(task.task_id, rnd.round, site)
            if a is not None and a.declined and a.attempt == rnd.attempt:
                continue  # declined for now: offered again when the round is retried (for good: not eligible)
            if a is None or a.attempt != rnd.attempt:
                if self.store.active_assignments(task.task_id, rnd.round, rnd.attempt) >= rnd.sites_target:
                    continue
                with self.store.transaction() as tx:
                    tx.assign(task.task_id, rnd.round, site, rnd.attempt, now_ms())
                    tx.add_event(task.task_id, "site-assigned", f"{site} joined round {rnd.round}", actor=site,
                                 round=rnd.round, attempt=rnd.attempt)
            manifest = self.store.model(rnd.base_model)
            assert manifest is not None
            assignment = agent_pb2.Assignment(
                task_id=task.task_id, round=rnd.round, attempt=rnd.attempt, spec=spec,
                model=manifest_to_proto(manifest), deadline_unix_ms=rnd.deadline_ms,
                send_tensors=sent_tensors(spec, manifest),
                downlink_deltas=self.store.model_deltas(rnd.base_model).values())
            signed = self.store.signed_task(task.task_id)
            if signed:  # the owner's signature, relayed as submitted: the site checks it (hospital_agent.gates)
                assignment.signed_task.ParseFromString(signed)
            items.append(agent_pb2.WorkItem(assignment=assignment))
            delivered[(task.task_id, rnd.round, rnd.attempt)] = True
        return items

    def ended_work(self, site: str, task_ids: Iterable[str]) -> list[agent_pb2.WorkItem]:
        """A cancellation (``CancelWork``; ``completed`` for a task that completed) for each of ``task_ids`` (the
        tasks a site says it still holds open, e.g. a privacy reservation, as its work stream opens) that has ended
        and was assigned to ``site``; unknown tasks and tasks of others are passed over in silence (a task id is not
        a capability: a site learns nothing of a task it had no part in)."""
        items = []
        for task_id in dict.fromkeys(task_ids):
            task = self.store.task(task_id)
            if task is None or not self.store.is_assigned(task_id, site):
                continue
            if task.state in (S.TASK_STATE_CANCELLED, S.TASK_STATE_FAILED):
                items.append(agent_pb2.WorkItem(cancel=agent_pb2.CancelWork(task_id=task_id, reason=task.error)))
            elif task.state == S.TASK_STATE_COMPLETED:
                items.append(agent_pb2.WorkItem(cancel=agent_pb2.CancelWork(task_id=task_id, reason="completed",
                                                                            completed=True)))
        return items

    def hold(self, site: str, task_id: str, rnd: int, reason: str) -> bool:
        """Record that ``site`` holds its assignment to round ``rnd`` (``reason``; "" = no longer); False when
        it is the same hold again. Refused when the site has no open assignment there."""
        reason = " ".join(reason.split())[:500]
        a = self.store.assignment(task_id, rnd, site)
        r = self.store.round(task_id, rnd)
        phase = self.store.result_phase(task_id)  # a result phase's assignment may be held too (awaiting approval)
        open_phase = phase is not None and phase.round == rnd and not phase.closed_ms
        if a is None or a.declined or ((r is None or r.state != S.ROUND_STATE_OPEN) and not open_phase):
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{site} has no open assignment to round {rnd} of task {task_id}; nothing to hold")
        if a.held == reason:
            return False  # the same hold again (the agent repeats it with every copy of the assignment)
        with self.store.transaction() as tx:
            tx.hold(task_id, rnd, site, reason)
            message = f"{site} holds round {rnd}: {reason}" if reason else f"{site} no longer holds round {rnd}"
            tx.add_event(task_id, "held", message, actor=site, round=rnd, reason=reason)
        log.info("site holds its assignment" if reason else "site released its hold", task_id=task_id,
                 round=rnd, site=site, reason=reason)
        return True

    def decline(self, site: str, task_id: str, rnd: int, reason: str, permanent: bool) -> None:
        """Record that ``site`` declined round ``rnd`` (``permanent``: the whole task)."""
        reason = reason.strip() or "no reason given"
        with self.store.transaction() as tx:
            tx.decline(task_id, rnd, site, reason, permanent)
            tx.add_event(task_id, "declined", f"{site} declined round {rnd}: {reason}", actor=site, round=rnd,
                         reason=reason, permanent=permanent)
        log.warning("site declined", task_id=task_id, round=rnd, site=site, reason=reason)
