"""The round engine: task lifecycle, site assignment, streaming aggregation, quorum and deadlines.

State machine of a task: QUEUED -> RUNNING -> COMPLETED | FAILED | CANCELLED. A running task has exactly
one OPEN round. A round closes (CLOSED) when ``sites_target`` updates have arrived, or at its deadline if
at least ``min_sites`` have; otherwise the task's quorum policy either reopens it (new attempt, new
deadline, up to ``max_round_retries`` times; updates already received are kept, they were computed on the
same global model) or fails the task. Nothing waits without a deadline.

Every accepted update is folded into the task's strategy accumulator right after it is durable; the
accumulator (O(model size)) is rebuilt from the durable updates after a restart. All state changes happen
under one lock and wake waiters through one condition variable (work streams, task watchers, the ticker).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import structlog

from fedclinic.runtime.blobstore import BlobStore, fsync_dir
from fedclinic.runtime.audit_trail import update_digest
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.transport.package import Manifest, TensorEntry, raw_bytes
from fedclinic.proto import agent_pb2, control_pb2, task_pb2, tensors_pb2
from fedclinic.secagg.task_config import spec_problems as secure_aggregation_problems
from fedclinic.spec.selection import select_names
from fedclinic.strategies import ClientDP, Strategy, make_strategy
from fedclinic.strategies.tensorsource import EncodedTensor, FileTensor, dense_blocks
from fedclinic.transport import codec_wire
from fedclinic.transport import downlink
from fedclinic.training import private_modules
from fedclinic.training import safl
from fedclinic.codecs import open_payload
from fedclinic.runtime.durable_file import DurableFile
from fedclinic.transport.wire import manifest_to_proto
from aggregator_service.metrics import AggregatorMetrics
from aggregator_service.secure_rounds import SecureRounds
from aggregator_service.store import Store, now_ms

log = structlog.get_logger("fedclinic.aggregator.engine")

S = control_pb2  # state enums
TERMINAL = (S.TASK_STATE_COMPLETED, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELLED)


class Refused(Exception):
    """A request the engine will not carry out; ``code`` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class UpdateLayout:
    """Where each tensor of an update lives inside its spill file."""

    tensors: list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, offset, nbytes
    #: name -> codec params (JSON) of tensors stored encoded (an update codec); the others are raw
    encoded: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps([[n, d, list(s), o, b, *([self.encoded[n]] if n in self.encoded else [])]
                           for n, d, s, o, b in self.tensors])

    @classmethod
    def from_json(cls, text: str) -> "UpdateLayout":
        rows = json.loads(text)
        return cls([(r[0], r[1], tuple(r[2]), r[3], r[4]) for r in rows], {r[0]: r[5] for r in rows if len(r) > 5})

    def tensors_in(self, path: Path) -> dict[str, FileTensor | EncodedTensor]:
        """The update's tensors as block-readable file ranges (never loaded whole); encoded ones are decoded
        while they are read (fedclinic.strategies.tensorsource.EncodedTensor)."""
        return {name: (EncodedTensor(path, offset, nbytes, self.encoded[name], shape) if name in self.encoded
                       else FileTensor(path, offset, dtype, shape))
                for name, dtype, shape, offset, nbytes in self.tensors}


@dataclass
class _Accumulator:
    round: int
    strategy: Strategy
    folded: set[str] = field(default_factory=set)  # update ids


def privacy_metrics(site_metrics: list[dict[str, float]], strategy) -> dict[str, float]:
    """A round's privacy figures: sample-level DP -> ``dp_epsilon`` / ``dp_delta`` = the largest cumulative spend
    any site reported (each site's guarantee covers its own records; the weakest one is the task's); client-level
    DP -> ``client_dp_epsilon`` (``client_dp_delta``) from the aggregator's own accountant, and the clip norm."""
    out: dict[str, float] = {}
    spends = [m["dp_epsilon"] for m in site_metrics if "dp_epsilon" in m]
    if spends:
        out["dp_epsilon"] = max(spends)
        out["dp_delta"] = max(m.get("dp_delta", 0.0) for m in site_metrics)
    if isinstance(strategy, ClientDP):
        out["client_dp_epsilon"] = strategy.epsilon()
        out["client_dp_delta"] = strategy.delta
        out["client_dp_clip_norm"] = strategy.clip_norm
    return out


def uplink_metrics(reports) -> dict[str, float]:
    """A round's update bytes summed over its sites: ``uplink_payload_bytes`` (tensor payloads as sent,
    encoded), ``uplink_fp32_bytes`` (the same tensors as float32 deltas), ``uplink_wire_bytes`` (serialized
    SubmitUpdate messages) and ``uplink_reduction`` = fp32 / payload. Empty without per-site updates (secure
    aggregation: see the round's ``uplink_bytes``)."""
    payload = sum(r.nbytes for r in reports)
    fp32 = sum(r.fp32_bytes for r in reports)
    if not reports or not fp32:
        return {}
    out = {"uplink_payload_bytes": float(payload), "uplink_fp32_bytes": float(fp32)}
    wire = sum(r.wire_bytes for r in reports)
    if wire:
        out["uplink_wire_bytes"] = float(wire)
    if payload:
        out["uplink_reduction"] = fp32 / payload
    return out


def update_layers(layout_json: str) -> list[int]:
    """The transformer layers a stored update carried (from its tensor names; fedclinic.training.safl.layer_of)."""
    return safl.layers_in_update(t[0] for t in UpdateLayout.from_json(layout_json).tensors)


def selection_metrics(per_site_layers: list[list[int]]) -> dict[str, float]:
    """SAFL's round figures: ``safl_layer_<l>_sites`` = how many sites sent layer l (a layer nobody sent is not
    listed). Counted from the tensors each update carried, not from what a site says it chose."""
    counts: dict[int, int] = {}
    for layers in per_site_layers:
        for layer in layers:
            counts[layer] = counts.get(layer, 0) + 1
    return {f"safl_layer_{layer}_sites": float(n) for layer, n in sorted(counts.items())}


def sent_tensors(spec: task_pb2.TaskSpec, manifest: Manifest) -> list[str]:
    """The tensors a site may send for ``spec``: the static selection (trainable/frozen/private patterns), and
    under SAFL only its layer and head tensors (each update then carries the head and at most top-k layers)."""
    names = select_names([t.name for t in manifest.tensors], spec.update.trainable_patterns,
                         spec.update.frozen_patterns, spec.update.private_patterns)
    return safl.sendable(names, spec.family) if spec.update.selection == safl.SAFL else names


def weighted_mean(reports: Iterable[tuple[int, dict[str, float]]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for n, metrics in reports:
        for k, v in metrics.items():
            if math.isfinite(v):
                totals[k] = totals.get(k, 0.0) + n * v
                weights[k] = weights.get(k, 0.0) + n
    return {k: totals[k] / weights[k] for k in totals if weights[k] > 0}


class Engine:
    def __init__(self, store: Store, blobs: BlobStore, *, clock: Callable[[], float] = time.time,
                 metrics: AggregatorMetrics | None = None) -> None:
        self.store = store
        self.blobs = blobs
        self.spill_root = store.state_dir / "updates"
        self.spill_root.mkdir(exist_ok=True)
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._acc: dict[str, _Accumulator] = {}
        self._connected: dict[str, int] = {}
        #: update codecs each site announced at Hello (a site that did not say Hello takes raw tasks only)
        self._codecs: dict[str, frozenset[str]] = {}
        self._stopping = False
        self._ticker: threading.Thread | None = None
        #: rounds of tasks with secure aggregation: one SecAgg(+) session each (aggregator_service.secure_rounds)
        self.secagg = SecureRounds(self)
        #: Prometheus metrics (aggregator_service.metrics); a private registry when none is given
        self.metrics = metrics if metrics is not None else AggregatorMetrics()
        self.metrics.attach(self)

    # lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            self._recover()
        self._ticker = threading.Thread(target=self._tick_loop, name="round-ticker", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.changed.notify_all()
        if self._ticker is not None:
            self._ticker.join(timeout=5)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _recover(self) -> None:
        """Rebuild accumulators of open rounds from durable updates; drop spill files nobody references."""
        referenced = {r.spill_path for r in self.store.all("SELECT spill_path FROM updates")}
        for path in self.spill_root.rglob("*"):
            if path.is_file() and str(path) not in referenced:
                path.unlink()
        for task in self.store.all("SELECT task_id FROM tasks WHERE state=?", (S.TASK_STATE_RUNNING,)):
            rnd = self._open_round(task.task_id)
            if rnd is None:
                continue
            acc = self._accumulator(task.task_id)
            rows = self.store.all("SELECT * FROM updates WHERE task_id=? AND round=? ORDER BY received_ms",
                                  (task.task_id, rnd.round))
            for u in rows:
                self._fold(acc, u.update_id, Path(u.spill_path), UpdateLayout.from_json(u.layout),
                           acc.strategy.weight_for(u.num_samples, json.loads(u.metrics)),
                           u.site)
            log.info("round recovered", task_id=task.task_id, round=rnd.round, updates=len(rows))
            self._maybe_close(task.task_id)

    # tasks ----------------------------------------------------------------------------------------------
    def create_task(self, owner: str, idempotency_key: str, spec: task_pb2.TaskSpec, manifest: Manifest) -> str:
        """Record a task whose model blobs are already durable, and open its first round."""
        validate_spec(spec, manifest)
        with self.lock:
            existing = self.store.one("SELECT task_id FROM tasks WHERE owner=? AND idempotency_key=?",
                                      (owner, idempotency_key))
            if existing is not None:
                return existing.task_id
            task_id = "t-" + uuid.uuid4().hex[:12]
            ts = now_ms()
            with self.store.tx() as c:
                model_hash = self.store.put_model(c, manifest)
                c.execute("INSERT INTO tasks(task_id, owner, idempotency_key, spec, state, created_ms, updated_ms,"
                          " initial_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                          (task_id, owner, idempotency_key, spec.SerializeToString(), S.TASK_STATE_QUEUED, ts, ts,
                           model_hash))
                self.store.add_event(c, task_id, "submitted", f"task {spec.name!r} submitted by {owner}", actor=owner,
                                     name=spec.name, family=spec.family, dataset=spec.dataset, model_hash=model_hash,
                                     rounds=spec.rounds.num_rounds)
                self._open_round_tx(c, task_id, spec, 1, 1, model_hash)
            log.info("task created", task_id=task_id, owner=owner, name=spec.name)
            self.changed.notify_all()
            return task_id

    def spec(self, task_id: str) -> task_pb2.TaskSpec:
        row = self.store.one("SELECT spec FROM tasks WHERE task_id=?", (task_id,))
        if row is None:
            raise Refused("NOT_FOUND", f"no task {task_id!r} on this aggregator; list tasks with `fedclinic task list`")
        return task_pb2.TaskSpec.FromString(row.spec)

    def cancel(self, task_id: str, by: str, reason: str) -> None:
        with self.lock:
            task = self._task(task_id)
            if task.state in TERMINAL:
                raise Refused("FAILED_PRECONDITION",
                              f"task {task_id} already ended ({S.TaskState.Name(task.state)}); nothing to cancel")
            with self.store.tx() as c:
                c.execute("UPDATE tasks SET state=?, error=?, updated_ms=? WHERE task_id=?",
                          (S.TASK_STATE_CANCELLED, f"cancelled by {by}: {reason}".strip(": "), now_ms(), task_id))
                self.store.add_event(c, task_id, "cancelled", f"cancelled by {by}" + (f": {reason}" if reason else ""),
                                     actor=by, reason=reason)
            self._drop_round_data(task_id)
            self.changed.notify_all()

    def _task(self, task_id: str):
        task = self.store.one("SELECT * FROM tasks WHERE task_id=?", (task_id,))
        if task is None:
            raise Refused("NOT_FOUND", f"no task {task_id!r} on this aggregator; list tasks with `fedclinic task list`")
        return task

    def _open_round(self, task_id: str):
        return self.store.one("SELECT * FROM rounds WHERE task_id=? AND state=?", (task_id, S.ROUND_STATE_OPEN))

    def _open_round_tx(self, c, task_id: str, spec: task_pb2.TaskSpec, rnd: int, attempt: int, base_model: str) -> None:
        rc = spec.rounds
        connected = [s for s in self._connected if self._eligible(task_id, spec, s)]
        target = max(rc.min_sites, math.ceil(rc.participation_fraction * len(connected)))
        opened = now_ms()
        deadline = opened + int(rc.round_timeout_s * 1000)
        c.execute("INSERT OR REPLACE INTO rounds(task_id, round, attempt, state, sites_target, opened_ms, deadline_ms,"
                  " base_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                  (task_id, rnd, attempt, S.ROUND_STATE_OPEN, target, opened, deadline, base_model))
        c.execute("UPDATE tasks SET state=?, current_round=?, updated_ms=? WHERE task_id=?",
                  (S.TASK_STATE_RUNNING, rnd, opened, task_id))
        self.store.add_event(c, task_id, "round-opened",
                             f"round {rnd} opened (attempt {attempt}); waiting for {target} site(s), "
                             f"deadline in {rc.round_timeout_s:g} s", round=rnd, attempt=attempt, base_model=base_model,
                             sites_target=target)

    def _eligible(self, task_id: str, spec: task_pb2.TaskSpec, site: str) -> bool:
        if spec.sites and site not in spec.sites:
            return False
        if spec.secure_aggregation.enabled and not self.secagg.capable(site):
            return False  # the agent did not announce "secagg-v1" at Hello
        if not self.supports_codec(site, spec.update.codec):
            return False  # the agent did not announce every codec the task's updates use
        return self.store.one("SELECT 1 FROM site_declines WHERE task_id=? AND site=?", (task_id, site)) is None

    # agents -------------------------------------------------------------------------------------------
    def hello_codecs(self, site: str, codecs: Iterable[str]) -> None:
        """Remember the update codecs ``site`` announced at Hello (``Capabilities.codecs``)."""
        with self.lock:
            self._codecs[site] = frozenset(codecs)
            self.changed.notify_all()

    def supports_codec(self, site: str, codec: str) -> bool:
        """Can ``site`` encode updates with the task codec ``codec`` (raw: every site)?"""
        try:
            needed = codec_wire.needed_codecs(codec)
        except ConfigError:
            return False
        return set(needed) <= self._codecs.get(site, frozenset())

    def site_connected(self, site: str) -> None:
        with self.lock:
            self._connected[site] = self._connected.get(site, 0) + 1
            self.changed.notify_all()

    def connected_count(self) -> int:
        """How many distinct sites have a work stream open now."""
        return len(self._connected)

    def site_disconnected(self, site: str) -> None:
        with self.lock:
            n = self._connected.get(site, 0) - 1
            if n <= 0:
                self._connected.pop(site, None)
            else:
                self._connected[site] = n

    def next_work(self, site: str, delivered: dict[tuple[str, int, int], bool]) -> list[agent_pb2.WorkItem]:
        """Work for ``site`` not yet delivered on this stream: new assignments and cancellations."""
        items: list[agent_pb2.WorkItem] = []
        with self.lock:
            for key in list(delivered):
                task = self.store.one("SELECT state, error FROM tasks WHERE task_id=?", (key[0],))
                rnd = self.store.one("SELECT state FROM rounds WHERE task_id=? AND round=?", (key[0], key[1]))
                if task is not None and task.state in (S.TASK_STATE_CANCELLED, S.TASK_STATE_FAILED):
                    items.append(agent_pb2.WorkItem(cancel=agent_pb2.CancelWork(task_id=key[0], reason=task.error)))
                    del delivered[key]
                elif rnd is None or rnd.state != S.ROUND_STATE_OPEN:
                    del delivered[key]
            for task in self.store.all("SELECT task_id, spec FROM tasks WHERE state=? ORDER BY created_ms",
                                       (S.TASK_STATE_RUNNING,)):
                spec = task_pb2.TaskSpec.FromString(task.spec)
                rnd = self._open_round(task.task_id)
                if rnd is None or not self._eligible(task.task_id, spec, site):
                    continue
                if (task.task_id, rnd.round, rnd.attempt) in delivered:
                    continue
                if self.store.one("SELECT 1 FROM updates WHERE task_id=? AND round=? AND site=?",
                                  (task.task_id, rnd.round, site)):
                    continue
                a = self.store.one("SELECT * FROM assignments WHERE task_id=? AND round=? AND site=?",
                                   (task.task_id, rnd.round, site))
                if a is not None and a.declined:
                    continue
                if a is None or a.attempt != rnd.attempt:
                    active = self.store.one(
                        "SELECT COUNT(*) AS n FROM assignments WHERE task_id=? AND round=? AND declined='' "
                        "AND (attempt=? OR site IN (SELECT site FROM updates WHERE task_id=? AND round=?))",
                        (task.task_id, rnd.round, rnd.attempt, task.task_id, rnd.round)).n
                    if active >= rnd.sites_target:
                        continue
                    with self.store.tx() as c:
                        c.execute("INSERT OR REPLACE INTO assignments(task_id, round, site, attempt, assigned_ms) "
                                  "VALUES (?, ?, ?, ?, ?)", (task.task_id, rnd.round, site, rnd.attempt, now_ms()))
                        self.store.add_event(c, task.task_id, "site-assigned", f"{site} joined round {rnd.round}",
                                             actor=site, round=rnd.round, attempt=rnd.attempt)
                manifest = self.store.model(rnd.base_model)
                assert manifest is not None
                send = sent_tensors(spec, manifest)
                items.append(agent_pb2.WorkItem(assignment=agent_pb2.Assignment(
                    task_id=task.task_id, round=rnd.round, attempt=rnd.attempt, spec=spec,
                    model=manifest_to_proto(manifest), deadline_unix_ms=rnd.deadline_ms, send_tensors=send,
                    downlink_deltas=self.store.model_deltas(rnd.base_model).values())))
                delivered[(task.task_id, rnd.round, rnd.attempt)] = True
        return items

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            if not self._stopping:
                self.changed.wait(timeout)

    def hold(self, site: str, task_id: str, rnd: int, reason: str) -> None:
        """``site`` holds its assignment to round ``rnd`` without refusing it (``reason``, e.g. awaiting approval by
        its IT), or no longer does (``reason`` empty). Shown to the task owner while the site has not reported;
        the round still waits for the site until its deadline. Refused when the site has no open assignment
        there."""
        reason = " ".join(reason.split())[:500]
        with self.lock:
            self._task(task_id)
            a = self.store.one("SELECT held FROM assignments a JOIN rounds r ON r.task_id=a.task_id AND "
                               "r.round=a.round WHERE a.task_id=? AND a.round=? AND a.site=? AND a.declined='' "
                               "AND r.state=?", (task_id, rnd, site, control_pb2.ROUND_STATE_OPEN))
            if a is None:
                raise Refused("FAILED_PRECONDITION", f"{site} has no open assignment to round {rnd} of task "
                                                     f"{task_id}; nothing to hold")
            if a.held == reason:
                return  # the same hold again (the agent repeats it with every copy of the assignment)
            with self.store.tx() as c:
                c.execute("UPDATE assignments SET held=? WHERE task_id=? AND round=? AND site=?",
                          (reason, task_id, rnd, site))
                message = (f"{site} holds round {rnd}: {reason}" if reason
                           else f"{site} no longer holds round {rnd}")
                self.store.add_event(c, task_id, "held", message, actor=site, round=rnd, reason=reason)
            log.info("site holds its assignment" if reason else "site released its hold", task_id=task_id,
                     round=rnd, site=site, reason=reason)
            self.changed.notify_all()

    def decline(self, site: str, task_id: str, rnd: int, reason: str, permanent: bool) -> None:
        with self.lock:
            self._task(task_id)
            reason = reason.strip() or "no reason given"
            with self.store.tx() as c:
                c.execute("UPDATE assignments SET declined=? WHERE task_id=? AND round=? AND site=?",
                          (reason, task_id, rnd, site))
                if permanent:
                    c.execute("INSERT OR REPLACE INTO site_declines(task_id, site, reason) VALUES (?, ?, ?)",
                              (task_id, site, reason))
                self.store.add_event(c, task_id, "declined", f"{site} declined round {rnd}: {reason}", actor=site,
                                     round=rnd, reason=reason, permanent=permanent)
            log.warning("site declined", task_id=task_id, round=rnd, site=site, reason=reason)
            self.secagg.declined(site, task_id, rnd)
            if self._open_round(task_id) is not None:
                self._maybe_close(task_id)
            if permanent and self._open_round(task_id) is not None:
                self._fail_if_unreachable(task_id)
            self.changed.notify_all()

    def _quorum_unreachable(self, task_id: str, spec: task_pb2.TaskSpec) -> str:
        """Why no round of the task can reach quorum any more ("" while it can): the task names its sites and
        so many of them declined it for good that fewer than ``min_sites`` are left. (A task open to every site
        cannot know this: another site may still connect.)"""
        if not spec.sites:
            return ""
        declined = {r.site: r.reason for r in self.store.all("SELECT site, reason FROM site_declines WHERE task_id=?",
                                                             (task_id,)) if r.site in spec.sites}
        able = [s for s in spec.sites if s not in declined]
        if len(able) >= spec.rounds.min_sites:
            return ""
        return (f"quorum can no longer be reached: {len(declined)} of the task's {len(spec.sites)} site(s) declined it "
                f"for good ({'; '.join(f'{s}: {r}' for s, r in sorted(declined.items()))}), which leaves "
                f"{len(able)} ({', '.join(able) or 'none'}) for min_sites {spec.rounds.min_sites}. Address the sites' "
                "reasons, or submit again with other sites or a lower min_sites")

    def _fail_if_unreachable(self, task_id: str) -> None:
        """Fail the task now, instead of at its deadlines, when :meth:`_quorum_unreachable` says so."""
        rnd = self._open_round(task_id)
        why = self._quorum_unreachable(task_id, self.spec(task_id))
        if rnd is None or not why:
            return
        self._fail_round(task_id, rnd.round, f"round {rnd.round}: {why}")
        log.warning("task failed: quorum unreachable", task_id=task_id, round=rnd.round)

    def add_downlink(self, task_id: str, nbytes: int, *, site: str = "", wire_bytes: int = 0) -> None:
        """Charge bytes sent to sites to the task's open round; with ``site`` also to that site's assignment
        (payload ``nbytes`` and ``wire_bytes`` as serialized)."""
        self.metrics.downlink_sent(task_id, nbytes)
        with self.lock:
            self.store.execute("UPDATE rounds SET downlink_bytes = downlink_bytes + ? WHERE task_id=? AND state=?",
                               (nbytes, task_id, S.ROUND_STATE_OPEN))
            if site:
                self.store.execute(
                    "UPDATE assignments SET downlink_bytes = downlink_bytes + ?, "
                    "downlink_wire_bytes = downlink_wire_bytes + ? WHERE task_id=? AND site=? AND round = "
                    "(SELECT round FROM rounds WHERE task_id=? AND state=?)",
                    (nbytes, wire_bytes, task_id, site, task_id, S.ROUND_STATE_OPEN))

    def add_uplink(self, task_id: str, rnd: int, nbytes: int) -> None:
        self.metrics.uplink(task_id, nbytes)
        with self.lock:
            self.store.execute("UPDATE rounds SET uplink_bytes = uplink_bytes + ? WHERE task_id=? AND round=?",
                               (nbytes, task_id, rnd))

    def close_secure_round(self, task_id: str, rnd: int, mean: dict[str, np.ndarray], metrics: dict[str, float],
                           summary: str) -> None:
        """Close round ``rnd`` with a secure-aggregation result: ``mean`` (the survivors' sum / their number, per
        tensor) is folded into the task's strategy as one update of weight 1 (uniform weights), then the round
        closes as usual with ``metrics`` added to its metrics."""
        with self.lock:
            current = self._open_round(task_id)
            if current is None or current.round != rnd:
                return
            acc = self._accumulator(task_id)
            try:
                acc.strategy.accept(mean, 1.0, site="secure-aggregate")
            except (IntegrityError, ValueError) as exc:
                self._fail_round(task_id, rnd, f"round {rnd}: the securely aggregated update was refused: {exc}")
                return
            self._close_round(task_id, extra_metrics=metrics, closed_with=summary)
            self.changed.notify_all()

    # updates ------------------------------------------------------------------------------------------
    def existing_update(self, task_id: str, idempotency_key: str):
        return self.store.one("SELECT * FROM updates WHERE task_id=? AND idempotency_key=?", (task_id, idempotency_key))

    def check_update_header(self, site: str, h: agent_pb2.UpdateHeader) -> dict[str, TensorEntry]:
        """Validate an update header before its bytes are read; returns the expected global tensors."""
        with self.lock:
            task = self._task(h.task_id)
            if task.state != S.TASK_STATE_RUNNING:
                raise Refused("FAILED_PRECONDITION",
                              f"task {h.task_id} is {S.TaskState.Name(task.state)}; it takes no more updates")
            rnd = self._open_round(h.task_id)
            if rnd is None or rnd.round != h.round:
                current = rnd.round if rnd is not None else task.current_round
                raise Refused("FAILED_PRECONDITION",
                              f"round {h.round} of task {h.task_id} is closed (the task is at round {current}); "
                              "the update was not stored")
            a = self.store.one("SELECT * FROM assignments WHERE task_id=? AND round=? AND site=?",
                               (h.task_id, h.round, site))
            if a is None or a.declined:
                raise Refused("PERMISSION_DENIED", f"site {site} is not a participant of round {h.round} of "
                                                   f"task {h.task_id}; wait for an assignment")
            if self.store.one("SELECT 1 FROM updates WHERE task_id=? AND round=? AND site=?", (h.task_id, h.round, site)):
                raise Refused("ALREADY_EXISTS", f"site {site} already sent an update for round {h.round} of task "
                                                f"{h.task_id} with another idempotency key")
            if h.base_model_hash != rnd.base_model:
                raise Refused("FAILED_PRECONDITION", f"the update was computed against model {h.base_model_hash[:12]}"
                                                     f" but round {h.round} started from {rnd.base_model[:12]}")
            if h.num_samples <= 0:
                raise Refused("INVALID_ARGUMENT", "num_samples must be positive (it is the FedAvg weight)")
            if h.kind != task_pb2.UPDATE_KIND_DELTA:
                raise Refused("INVALID_ARGUMENT", "only delta updates (UPDATE_KIND_DELTA) are accepted")
            spec = task_pb2.TaskSpec.FromString(task.spec)
            manifest = self.store.model(rnd.base_model)
            assert manifest is not None
            allowed = set(sent_tensors(spec, manifest))
            by_name = {t.name: t for t in manifest.tensors}
            seen: set[str] = set()
            for t in h.tensors:
                ref = by_name.get(t.name)
                if ref is None or t.name not in allowed:
                    raise Refused("INVALID_ARGUMENT", f"tensor {t.name!r} is not one this task trains and sends")
                if t.name in seen:
                    raise Refused("INVALID_ARGUMENT", f"tensor {t.name!r} appears twice in the update")
                seen.add(t.name)
                if tuple(t.shape) != tuple(ref.shape):
                    raise Refused("INVALID_ARGUMENT", f"tensor {t.name!r} has shape {list(t.shape)}; the model's is "
                                                      f"{list(ref.shape)}")
                if t.dtype != "float32":
                    raise Refused("INVALID_ARGUMENT", f"tensor {t.name!r}: deltas must be float32, got {t.dtype}")
                self._check_tensor_codec(spec, t)
            if not seen:
                raise Refused("INVALID_ARGUMENT", "the update carries no tensor")
            if spec.update.selection == safl.SAFL:
                try:
                    safl.check_update_layers(seen, spec.update.select_top_k_layers)
                except IntegrityError as exc:
                    raise Refused("INVALID_ARGUMENT", str(exc)) from None
            return {n: by_name[n] for n in seen}

    @staticmethod
    def _check_tensor_codec(spec: task_pb2.TaskSpec, t) -> None:
        """A tensor of an update must use the task's codec with the task's parameters (INVALID_ARGUMENT)."""
        want = codec_wire.canonical(spec.update.codec)
        got = t.codec or codec_wire.RAW
        if got != want:
            raise Refused("INVALID_ARGUMENT", f"tensor {t.name!r} is encoded with codec {got!r}, but the task's "
                                              f"updates use {want!r}")
        codec = codec_wire.task_codec(want)
        try:
            if codec is None:
                if t.codec_params:
                    raise IntegrityError(f"tensor {t.name!r}: codec 'raw' takes no codec_params")
            else:
                codec_wire.check_header(t.name, t.codec, t.dtype, list(t.shape), int(t.encoded_nbytes))
                codec_wire.params_of(t.name, codec, list(t.shape), dict(t.codec_params))
        except IntegrityError as exc:
            raise Refused("INVALID_ARGUMENT", str(exc)) from None

    def prepare_update(self, h: agent_pb2.UpdateHeader, spill: Path, layout: UpdateLayout) -> tuple[Path, UpdateLayout]:
        """Check the payload of every encoded tensor of a received (durable) update completely; then keep it
        encoded for a linear strategy (decoded into the accumulator when folded) or decode it, chunk by chunk,
        into a float32 spill file for a strategy that looks at each update. Raw updates pass unchanged.
        IntegrityError (nothing kept) for a malformed payload."""
        spec = self.spec(h.task_id)
        codec = codec_wire.task_codec(spec.update.codec)
        if codec is None:
            return spill, layout
        by_name = {t.name: t for t in h.tensors}
        params = {name: codec_wire.params_of(name, codec, list(by_name[name].shape), dict(by_name[name].codec_params))
                  for name, *_ in layout.tensors}
        encoded = UpdateLayout(list(layout.tensors), {n: json.dumps(p, separators=(",", ":")) for n, p in params.items()})
        for name, _, _, _, _ in layout.tensors:  # full validation before anything is folded or kept
            t = encoded.tensors_in(spill)[name]
            try:
                open_payload(t.payload(), params[name])
            except IntegrityError as exc:
                raise IntegrityError(f"tensor {name!r}: {exc}") from None
        if not strategy_of(spec).needs_per_site_updates:
            return spill, encoded
        dense_path = spill.with_name(spill.stem + ".f32")
        out = DurableFile(dense_path.with_suffix(".part"))
        dense = UpdateLayout([])
        scratch = np.empty(1 << 16, dtype=np.float32)
        offset = 0
        try:
            for name, _, shape, _, _ in layout.tensors:
                t = encoded.tensors_in(spill)[name]
                reader = open_payload(t.payload(), params[name], chunk=scratch.size)
                for _, block in dense_blocks(reader.chunks(), t.size, scratch):
                    out.write(memoryview(block).cast("B"))
                dense.tensors.append((name, "float32", shape, offset, 4 * t.size))
                offset += 4 * t.size
            out.close()
        except BaseException:
            out.discard()
            dense_path.with_suffix(".part").unlink(missing_ok=True)
            raise
        os.replace(dense_path.with_suffix(".part"), dense_path)
        fsync_dir(dense_path.parent)
        spill.unlink(missing_ok=True)
        return dense_path, dense

    def spill_path(self, task_id: str, rnd: int) -> Path:
        d = self.spill_root / task_id / str(rnd)
        d.mkdir(parents=True, exist_ok=True)
        return d / f"u-{uuid.uuid4().hex}.bin"

    def accept_update(self, site: str, h: agent_pb2.UpdateHeader, spill: Path, layout: UpdateLayout,
                      nbytes: int, wire_bytes: int = 0) -> str:
        """Fold a verified, fsync'd update into the round, then record it durably. Returns its update id.
        ``nbytes``: the tensors' payload bytes as sent (encoded); ``wire_bytes``: the serialized
        SubmitUpdate messages (with gRPC's 5-byte message prefix); the fp32-equivalent size comes from the
        shapes."""
        with self.lock:
            prior = self.existing_update(h.task_id, h.idempotency_key)
            if prior is not None:
                spill.unlink(missing_ok=True)
                return prior.update_id
            self.check_update_header(site, h)  # the round may have closed while the bytes streamed in
            update_id = "u-" + uuid.uuid4().hex[:16]
            acc = self._accumulator(h.task_id)
            try:  # fold first: a strategy that rejects an update leaves itself unchanged (Strategy contract)
                self._fold(acc, update_id, spill, layout, acc.strategy.weight_for(h.num_samples, h.metrics), site)
            except (IntegrityError, ValueError) as exc:
                spill.unlink(missing_ok=True)
                raise Refused("INVALID_ARGUMENT", f"update rejected by the {acc.strategy.name} strategy: {exc}") from None
            try:
                with self.store.tx() as c:
                    c.execute("INSERT INTO updates(update_id, task_id, round, site, idempotency_key, num_samples, "
                              "nbytes, spill_path, layout, metrics, eval_metrics, received_ms, fp32_bytes, "
                              "wire_bytes) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                              (update_id, h.task_id, h.round, site, h.idempotency_key, h.num_samples, nbytes,
                               str(spill), layout.to_json(), json.dumps(dict(h.metrics)),
                               json.dumps(dict(h.eval_metrics)), now_ms(),
                               sum(4 * math.prod(t.shape) for t in h.tensors), wire_bytes))
                    c.execute("UPDATE rounds SET uplink_bytes = uplink_bytes + ? WHERE task_id=? AND round=?",
                              (nbytes, h.task_id, h.round))
                    self.store.add_event(c, h.task_id, "update-received",
                                         f"{site} sent its round {h.round} update ({nbytes} bytes, "
                                         f"{h.num_samples} samples)", actor=site, round=h.round,
                                         update_id=update_id, size=nbytes, sha256=update_digest(h.tensors),
                                         num_samples=h.num_samples)
            except BaseException:
                self._acc.pop(h.task_id, None)  # it holds an update the store does not: rebuild from disk
                raise
            log.info("update accepted", task_id=h.task_id, round=h.round, site=site, nbytes=nbytes)
            self.metrics.update_stored(h.task_id, site, nbytes, wire_bytes)
            self._maybe_close(h.task_id)
            self.changed.notify_all()
            return update_id

    def _accumulator(self, task_id: str) -> _Accumulator:
        rnd = self._open_round(task_id)
        assert rnd is not None
        acc = self._acc.get(task_id)
        if acc is None or acc.round != rnd.round:
            spec = self.spec(task_id)
            manifest = self.store.model(rnd.base_model)
            assert manifest is not None
            tensors = {t.name: FileTensor(self.blobs.path(t.sha256), 0, t.dtype, t.shape) for t in manifest.tensors}
            strategy = strategy_of(spec)
            strategy.load_state(self._saved_strategy_state(task_id, rnd.round - 1))
            strategy.begin(tensors)
            acc = self._acc[task_id] = _Accumulator(rnd.round, strategy)
        return acc

    def _saved_strategy_state(self, task_id: str, rnd: int) -> dict[str, np.ndarray]:
        """The strategy state stored with round ``rnd`` (empty for round 0 or a stateless strategy)."""
        row = self.store.one("SELECT strategy_state FROM rounds WHERE task_id=? AND round=?", (task_id, rnd))
        if row is None:
            return {}
        return {key: np.array(self.blobs.array(sha, dtype, tuple(shape)))
                for key, (sha, dtype, shape) in json.loads(row.strategy_state).items()}

    @staticmethod
    def _fold(acc: _Accumulator, update_id: str, spill: Path, layout: UpdateLayout, weight: float, site: str) -> None:
        if update_id in acc.folded:
            return
        acc.strategy.accept(layout.tensors_in(spill), float(weight), site=site)
        acc.folded.add(update_id)

    # closing rounds -------------------------------------------------------------------------------------
    def _maybe_close(self, task_id: str) -> None:
        rnd = self._open_round(task_id)
        if rnd is None or self._task(task_id).state != S.TASK_STATE_RUNNING:
            return
        n = self.store.one("SELECT COUNT(*) AS n FROM updates WHERE task_id=? AND round=?", (task_id, rnd.round)).n
        if n >= rnd.sites_target:
            self._close_round(task_id)
        elif n >= self.spec(task_id).rounds.min_sites and not self._could_still_report(task_id, rnd):
            self._close_round(task_id)  # quorum reached and nobody else can report: no point waiting

    def _could_still_report(self, task_id: str, rnd) -> bool:
        """Is some site assigned and not yet reported, or connected, eligible and not yet assigned?"""
        outstanding = self.store.one(
            "SELECT COUNT(*) AS n FROM assignments a WHERE task_id=? AND round=? AND declined='' AND NOT EXISTS "
            "(SELECT 1 FROM updates u WHERE u.task_id=a.task_id AND u.round=a.round AND u.site=a.site)",
            (task_id, rnd.round)).n
        if outstanding:
            return True
        spec = self.spec(task_id)
        assigned = {a.site for a in self.store.all("SELECT site FROM assignments WHERE task_id=? AND round=?",
                                                   (task_id, rnd.round))}
        return any(s not in assigned and self._eligible(task_id, spec, s) for s in self._connected)

    def _close_round(self, task_id: str, *, extra_metrics: dict[str, float] | None = None,
                     closed_with: str = "") -> None:
        rnd = self._open_round(task_id)
        assert rnd is not None
        spec = self.spec(task_id)
        acc = self._accumulator(task_id)
        try:
            new_arrays = acc.strategy.finalize()
        except (IntegrityError, ValueError) as exc:
            self._fail_round(task_id, rnd.round,
                             f"round {rnd.round}: the {spec.strategy or 'fedavg'} aggregation failed: {exc}")
            log.error("aggregation failed", task_id=task_id, round=rnd.round, error=str(exc))
            return
        base = self.store.model(rnd.base_model)
        assert base is not None
        entries, deltas = [], []
        codec = downlink.downlink_codec(spec.update.downlink_codec)
        for t in base.tensors:
            arr = new_arrays.get(t.name)
            if arr is None:
                entries.append(t)
                continue
            delta = None
            if codec is not None and t.dtype == "float32" and arr.size:  # the broadcast model is the global one
                arr, delta = self._broadcast_delta(task_id, rnd.round, t, arr, codec)
            sha = self.blobs.put(raw_bytes(arr))
            entries.append(TensorEntry(t.name, t.dtype, t.shape, sha, t.nbytes))
            if delta is not None and sha != t.sha256:
                deltas.append(delta)
        manifest = Manifest(tuple(entries), base.files)
        saved_state = {key: [self.blobs.put(raw_bytes(arr)), str(arr.dtype), list(arr.shape)]
                       for key, arr in acc.strategy.state().items()}
        reports = self.store.all("SELECT num_samples, metrics, eval_metrics, nbytes, fp32_bytes, wire_bytes, layout "
                                 "FROM updates WHERE task_id=? AND round=?", (task_id, rnd.round))
        site_metrics = [json.loads(r.metrics) for r in reports]
        metrics = weighted_mean((r.num_samples, m) for r, m in zip(reports, site_metrics))
        metrics.update({f"eval_{k}": v for k, v in
                        weighted_mean((r.num_samples, json.loads(r.eval_metrics)) for r in reports).items()})
        metrics.update(privacy_metrics(site_metrics, acc.strategy))
        metrics.update(uplink_metrics(reports))
        if spec.update.selection == safl.SAFL:
            metrics.update(selection_metrics([update_layers(r.layout) for r in reports]))
        metrics.update(extra_metrics or {})
        with self.store.tx() as c:
            model_hash = self.store.put_model(c, manifest)
            self.store.put_model_deltas(c, model_hash, deltas)
            c.execute("UPDATE rounds SET state=?, closed_ms=?, model_hash=?, metrics=?, strategy_state=? "
                      "WHERE task_id=? AND round=?", (S.ROUND_STATE_CLOSED, now_ms(), model_hash, json.dumps(metrics),
                                                      json.dumps(saved_state), task_id, rnd.round))
            self.store.add_event(c, task_id, "round-closed",
                                 f"round {rnd.round} closed with {closed_with or f'{len(reports)} update(s)'}; "
                                 f"model {model_hash[:12]}", round=rnd.round, model_hash=model_hash,
                                 updates=len(reports))
            if rnd.round >= spec.rounds.num_rounds:
                c.execute("UPDATE tasks SET state=?, final_model=?, updated_ms=? WHERE task_id=?",
                          (S.TASK_STATE_COMPLETED, model_hash, now_ms(), task_id))
                self.store.add_event(c, task_id, "completed", f"task completed after {rnd.round} round(s)",
                                     final_model=model_hash, rounds=rnd.round)
            else:
                self._open_round_tx(c, task_id, spec, rnd.round + 1, 1, model_hash)
        log.info("round closed", task_id=task_id, round=rnd.round, updates=len(reports), model=model_hash[:12])
        self._acc.pop(task_id, None)
        shutil.rmtree(self.spill_root / task_id / str(rnd.round), ignore_errors=True)

    def _broadcast_delta(self, task_id: str, rnd: int, base: TensorEntry, new: np.ndarray, codec
                         ) -> tuple[np.ndarray, tensors_pb2.DownlinkDelta]:
        """Round ``rnd``'s global tensor under the task's downlink codec (fedclinic.transport.downlink): the base tensor plus
        the decoded change, and that change as agents fetch it (its payload stored as a blob)."""
        broadcast, enc = downlink.compress(self.blobs.array(base.sha256, base.dtype, base.shape), new, codec,
                                           downlink.tensor_rng(task_id, rnd, base.name))
        payload_sha = self.blobs.put(enc.payload)
        header = tensors_pb2.TensorHeader(name=base.name, dtype="float32", shape=list(base.shape), codec=codec.spec,
                                          sha256=payload_sha, encoded_nbytes=len(enc.payload),
                                          codec_params=codec_wire.header_params(enc))
        return broadcast, tensors_pb2.DownlinkDelta(name=base.name, base_sha256=base.sha256, header=header)

    def _fail_round(self, task_id: str, rnd: int, message: str) -> None:
        """Round ``rnd`` failed and takes the task with it (``message`` says why); its spilled updates go."""
        with self.store.tx() as c:
            c.execute("UPDATE rounds SET state=?, closed_ms=? WHERE task_id=? AND round=?",
                      (S.ROUND_STATE_FAILED, now_ms(), task_id, rnd))
            self._fail(c, task_id, message)
        self._drop_round_data(task_id)

    def _fail(self, c, task_id: str, message: str) -> None:
        c.execute("UPDATE tasks SET state=?, error=?, updated_ms=? WHERE task_id=?",
                  (S.TASK_STATE_FAILED, message, now_ms(), task_id))
        self.store.add_event(c, task_id, "failed", message)

    def _drop_round_data(self, task_id: str) -> None:
        self._acc.pop(task_id, None)
        shutil.rmtree(self.spill_root / task_id, ignore_errors=True)

    def tick(self) -> float:
        """Apply deadlines; returns seconds until the next deadline (capped at 1 s)."""
        wait = 1.0
        with self.lock:
            now = now_ms()
            for rnd in self.store.all("SELECT r.* FROM rounds r JOIN tasks t USING (task_id) WHERE r.state=? AND t.state=?",
                                      (S.ROUND_STATE_OPEN, S.TASK_STATE_RUNNING)):
                if now < rnd.deadline_ms:
                    wait = min(wait, (rnd.deadline_ms - now) / 1000)
                    continue
                self._deadline_passed(rnd)
            wait = min(wait, self.secagg.tick())
            self.changed.notify_all()
        return max(wait, 0.01)

    def _deadline_passed(self, rnd) -> None:
        task_id = rnd.task_id
        spec = self.spec(task_id)
        rc = spec.rounds
        n = self.store.one("SELECT COUNT(*) AS n FROM updates WHERE task_id=? AND round=?", (task_id, rnd.round)).n
        if n >= rc.min_sites:
            self._close_round(task_id)
            return
        missed = (f"round {rnd.round} got {n} of the {rc.min_sites} update(s) it needs by its deadline "
                  f"({rc.round_timeout_s:g} s, attempt {rnd.attempt})")
        unable = sorted(s for s in self._connected if not self.supports_codec(s, spec.update.codec))
        if unable:
            missed += (f"; connected site(s) {', '.join(unable)} did not announce the update codec "
                       f"{spec.update.codec!r} at Hello (upgrade their agents or choose another codec)")
        retry = rc.on_quorum_miss == task_pb2.QUORUM_POLICY_RETRY and rnd.attempt <= rc.max_round_retries
        if retry:
            with self.store.tx() as c:
                self.store.add_event(c, task_id, "round-failed", missed + "; quorum policy is 'retry': reopening",
                                     round=rnd.round, attempt=rnd.attempt)
                deadline = now_ms() + int(rc.round_timeout_s * 1000)
                c.execute("UPDATE rounds SET attempt=attempt+1, deadline_ms=? WHERE task_id=? AND round=?",
                          (deadline, task_id, rnd.round))
        else:
            policy = "retry, and the retries are used up" if rc.on_quorum_miss == task_pb2.QUORUM_POLICY_RETRY else "fail"
            self._fail_round(task_id, rnd.round, f"{missed}; quorum policy is '{policy}'. Check that enough agents "
                                                 "are connected and allowed to join (see declined events), or lower "
                                                 "min_sites")
        log.warning("round missed quorum", task_id=task_id, round=rnd.round, updates=n, retry=retry)

    def _tick_loop(self) -> None:
        while not self._stopping:
            try:
                wait = self.tick()
            except Exception:  # keep deadlines alive whatever happens; the error is logged
                log.exception("round ticker failed")
                wait = 1.0
            with self.changed:
                if not self._stopping:
                    self.changed.wait(wait)


def strategy_of(spec: task_pb2.TaskSpec):
    """The task's strategy, built from its numeric parameters and its string options."""
    return make_strategy(spec.strategy, {**dict(spec.strategy_params), **dict(spec.strategy_options)})


def privacy_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """The task's privacy settings, checked as fedclinic.spec.task.Task checks them (the SDK may be another version)."""
    pc = spec.privacy
    if not pc.level:
        return []
    if pc.level == "client":
        return [] if spec.strategy == "dp-fedavg" else [
            'privacy level "client" needs strategy "dp-fedavg" (clip and noise of whole updates at the aggregator)']
    if pc.level != "sample":
        return [f'privacy level must be "sample" or "client", got {pc.level!r}']
    problems = []
    if (pc.target_epsilon > 0) == (pc.noise_multiplier > 0):
        problems.append("privacy: give target_epsilon or noise_multiplier (positive), not both")
    if not 0 < pc.target_delta < 1:
        problems.append("privacy: target_delta must be in (0, 1)")
    if pc.accountant not in ("", "rdp", "prv"):
        problems.append(f"privacy: accountant {pc.accountant!r} is not rdp or prv")
    if spec.strategy == "dp-fedavg":
        problems.append('privacy level "sample" already noises at the sites; "dp-fedavg" is for level "client"')
    from fedclinic.privacy.dp_sgd import check_supported  # torch-free: the table of DP-SGD-capable models

    try:
        check_supported(spec.family or "text-classification", spec.architecture or "transformer")
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def selection_problems(spec: task_pb2.TaskSpec, strategy, names: list[str]) -> list[str]:
    """The task's layer selection, checked as fedclinic.spec.task.Task checks it, plus against the model's tensors."""
    u = spec.update
    problems = safl.config_problems(u.selection, u.select_top_k_layers, u.safl_profile_samples, u.safl_token,
                                    spec.family, spec.architecture)
    if u.selection != safl.SAFL or problems:
        return problems
    return (safl.composition_problems(strategy, spec.secure_aggregation.enabled)
            + safl.model_problems(names, spec.family, u.select_top_k_layers))


def validate_spec(spec: task_pb2.TaskSpec, manifest: Manifest) -> None:
    """Reject task specs that cannot run, with a message that says what to change."""
    rc = spec.rounds
    problems = []
    if not spec.name:
        problems.append("name is empty")
    if not spec.family:
        problems.append("family is empty")
    if not spec.dataset:
        problems.append("dataset is empty (name a dataset of the sites' registries)")
    if rc.num_rounds < 1:
        problems.append("rounds.num_rounds must be >= 1")
    if rc.min_sites < 1:
        problems.append("rounds.min_sites must be >= 1")
    if not 0 < rc.participation_fraction <= 1:
        problems.append("rounds.participation_fraction must be in (0, 1]")
    if rc.round_timeout_s <= 0:
        problems.append("rounds.round_timeout_s must be > 0")
    if rc.on_quorum_miss == task_pb2.QUORUM_POLICY_UNSPECIFIED:
        problems.append("rounds.on_quorum_miss must be 'retry' or 'fail'")
    problems.extend(secure_aggregation_problems(spec))
    problems.extend(privacy_problems(spec))
    if spec.tokenizer_sha256:
        tokenizer = next((f for f in manifest.files if f.path == "tokenizer.json"), None)
        if tokenizer is None or tokenizer.sha256 != spec.tokenizer_sha256:
            problems.append("tokenizer_sha256 does not match the model's tokenizer.json (data contract: every site "
                            "tokenizes with the tokenizer the task declares); submit the model with its own tokenizer")
    problems.extend(codec_wire.spec_problems(spec.update.codec, secure_aggregation=spec.secure_aggregation.enabled))
    problems.extend(downlink.spec_problems(spec.update.downlink_codec))
    try:
        strategy = strategy_of(spec)
        if "gradient_change_rate" in strategy.site_metrics() and not spec.training.measure_gradient_change:
            problems.append(f"strategy {strategy.name!r} weights sites by their gradient_change_rate; set "
                            "training.measure_gradient_change = true")
        if rc.min_sites < strategy.min_updates():
            problems.append(f"strategy {strategy.name!r} needs at least {strategy.min_updates()} updates per round; "
                            f"raise rounds.min_sites (now {rc.min_sites}) or change the strategy's parameters")
        names = select_names([t.name for t in manifest.tensors], spec.update.trainable_patterns,
                             spec.update.frozen_patterns, spec.update.private_patterns)
        private_modules.private_names([t.name for t in manifest.tensors], spec.update.private_patterns,
                                      frozen=spec.update.frozen_patterns)  # each pattern must name some tensor
        problems.extend(selection_problems(spec, strategy, names))
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise Refused("INVALID_ARGUMENT", "task spec rejected: " + "; ".join(problems))


def latest_model_hash(store: Store, task_id: str) -> str:
    """The task's final model, else its newest aggregated round's; "" when no round has finished."""
    task = store.one("SELECT final_model FROM tasks WHERE task_id=?", (task_id,))
    if task is None:
        return ""
    row = store.one("SELECT model_hash FROM rounds WHERE task_id=? AND model_hash!='' ORDER BY round DESC LIMIT 1",
                    (task_id,))
    return task.final_model or (row.model_hash if row else "")


def status_of(store: Store, task_id: str) -> control_pb2.TaskStatus:
    """The task as the control API reports it."""
    t = store.one("SELECT * FROM tasks WHERE task_id=?", (task_id,))
    if t is None:
        raise Refused("NOT_FOUND", f"no task {task_id!r} on this aggregator; list tasks with `fedclinic task list`")
    out = control_pb2.TaskStatus(task_id=t.task_id, spec=task_pb2.TaskSpec.FromString(t.spec), state=t.state,
                                 current_round=t.current_round, error=t.error, owner=t.owner,
                                 created_unix_ms=t.created_ms, updated_unix_ms=t.updated_ms,
                                 initial_model_hash=t.initial_model, final_model_hash=t.final_model)
    for r in store.all("SELECT * FROM rounds WHERE task_id=? ORDER BY round", (task_id,)):
        assigned = store.all("SELECT site, declined, held, downlink_bytes, downlink_wire_bytes FROM assignments "
                             "WHERE task_id=? AND round=? ORDER BY site", (task_id, r.round))
        fetched = {a.site: a for a in assigned}
        rs = control_pb2.RoundSummary(
            round=r.round, state=r.state, attempt=r.attempt, sites_target=r.sites_target,
            sites_assigned=[a.site for a in assigned if not a.declined],
            declined=[f"{a.site}: {a.declined}" for a in assigned if a.declined],
            metrics=json.loads(r.metrics), uplink_bytes=r.uplink_bytes, downlink_bytes=r.downlink_bytes,
            opened_unix_ms=r.opened_ms, closed_unix_ms=r.closed_ms, deadline_unix_ms=r.deadline_ms,
            model_hash=r.model_hash, downlink_wire_bytes=sum(a.downlink_wire_bytes for a in assigned))
        safl_task = out.spec.update.selection == safl.SAFL
        reported: set[str] = set()
        for u in store.all("SELECT site, num_samples, nbytes, metrics, eval_metrics, fp32_bytes, wire_bytes, layout "
                           "FROM updates WHERE task_id=? AND round=? ORDER BY site", (task_id, r.round)):
            rs.reports.append(control_pb2.SiteReport(site_id=u.site, num_samples=u.num_samples, uplink_bytes=u.nbytes,
                                                     metrics=json.loads(u.metrics),
                                                     eval_metrics=json.loads(u.eval_metrics),
                                                     uplink_fp32_bytes=u.fp32_bytes, uplink_wire_bytes=u.wire_bytes,
                                                     selected_layers=update_layers(u.layout) if safl_task else [],
                                                     downlink_bytes=fetched[u.site].downlink_bytes
                                                     if u.site in fetched else 0,
                                                     downlink_wire_bytes=fetched[u.site].downlink_wire_bytes
                                                     if u.site in fetched else 0))
            reported.add(u.site)
        if r.state == control_pb2.ROUND_STATE_OPEN:
            rs.held.extend(f"{a.site}: {a.held}" for a in assigned if a.held and not a.declined
                           and a.site not in reported)
        out.rounds.append(rs)
    return out
