"""Secure aggregation in the round engine: each round of a ``[secure_aggregation]`` task is a SecAgg(+) session.

The protocol itself is :mod:`fedclinic.secagg` (transport-free); this module drives one
:class:`~fedclinic.secagg.ServerSession` per round attempt over the agent service (messages in
``protos/fedclinic/v1/agent.proto``, walk-through in ``docs/protocol.md``):

0. **join**: an assigned site trains as usual, then calls ``SecAggRespond(join)`` naming the model it trained
   on. The session starts once ``sites_target`` sites joined, or, with at least ``floor = max(3, min_cohort,
   min_sites)`` joined, when nobody else can join or at the join deadline (half of ``round_timeout_s`` after
   the attempt opened). Its cohort is the joined sites; each gets ``SecAggSetup`` on its work stream.
1. **advertise keys** (each pair signed by the site's certificate key, "secagg-keys") -> ``SecAggKeyDirectory`` to
   those who advertised, every entry with its site's signed statement (relayed, not re-signed: each site checks
   every entry against its CA itself);
2. **share keys** -> ``SecAggMaskedInputRequest`` (alive set + the ciphertexts addressed to the site);
3. **masked input** (``SubmitUpdate`` with ``secagg_session_id``: one tensor in the session's ring,
   ``uint16``/``uint32``/``uint64``, no sample count, no metrics beside it: they are inside it, see
   :mod:`fedclinic.secagg.vector_layout`) -> ``SecAggSurvivors`` (U3) to the survivors;
4. **consistency**: each survivor signs U3 ("secagg-survivors") -> ``SecAggUnmaskRequest`` (survivors, dropped and
   every signature) to the survivors that signed;
5. **unmask** -> :meth:`ServerSession.finish` -> the survivors' sum.

Each phase closes when every expected site answered or at its deadline (a tenth of ``round_timeout_s``,
at least 1 s, after the phase opened); the library's ``close_*`` / ``finish`` then carry on without the
silent sites (dropout recovery) or abort. The result is decoded by the session's layout: per tensor the
survivors' weighted sum over their summed weight (sample counts, capped; per tensor under SAFL, where a tensor no
survivor sent is left out), and the evaluation metrics' weighted means (``eval_<name>``, as a plain round reports
them). The means are handed to the task's strategy as one update of weight 1 and the round closes through the
engine's usual path.

An abort (too few sites left, inconsistent shares, a refusal reported as a decline) sends ``SecAggAbort``
with ``rejoin = true``: sites that revealed nothing join again and a *new* session (fresh nonce, fresh keys)
starts, at most :data:`MAX_SESSIONS_PER_ATTEMPT` times per attempt. Session state lives in memory only: an
aggregator restart loses it, the agents re-join when their assignment is delivered again, and the round is
re-keyed. The engine's round deadline and quorum policy bound everything (a round whose session did not
finish by then counts as a quorum miss: retry with a new attempt, or fail).

Every method runs under the engine's lock and wakes waiters through its condition variable. The coordinator
knows the engine only through :class:`SecureRoundHost` (lock, store, eligibility, byte accounting, closing).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
import threading
from typing import Iterable, Protocol

import grpc
import numpy as np
import structlog

from fedclinic.errors import Refused
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.runtime.failpoints import failpoint
from fedclinic.proto import agent_pb2, control_pb2, task_pb2
from fedclinic.secagg import (AdvertiseKeys, AggregateResult, MaskedInput, Phase, SecAggAbort, SecAggConfigError,
                              SecAggError, SecAggIntegrityError, SecAggProtocolError, ServerSession, ShareKeys,
                              SurvivorsSignature, UnmaskResponse)
from fedclinic.secagg.task_config import floor_of, layout_for, session_params
from fedclinic.secagg.vector_layout import MAX_METRICS, VectorLayout, index_seed

from aggregator_service import distributed_dp
from aggregator_service.stakes import require_assignment
from aggregator_service.update_admission import sent_tensors
from aggregator_service.store import RoundRecord, Store, now_ms

log = structlog.get_logger("fedclinic.aggregator.secagg")
S = control_pb2

FEATURE = "secagg-v2"
"""The Hello feature of agents (and aggregators) that speak these phases: signed keys and the consistency round.
An agent that announces only ``secagg-v1`` is not given secure tasks (logged at Hello)."""
MASKED_TENSOR = "secagg.masked_input"
"""Name of the one tensor of a masked-input upload (the session's ring dtype, [the layout's length])."""
MAX_METRIC_NAME = 64
"""Longest evaluation-metric name a join may list."""
MAX_SESSIONS_PER_ATTEMPT = 3
JOIN_FRACTION = 0.5      # of round_timeout_s: how long after an attempt opens sites may still join
PHASE_FRACTION = 0.1     # of round_timeout_s: each phase's window
MIN_WINDOW_MS = 1000


@dataclass
class _Round:
    """One round attempt of a secure task, and its current session (if any)."""

    task_id: str
    round: int
    attempt: int
    base_model: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    vector_length: int
    join_deadline_ms: int
    window_ms: int
    joined: dict[str, int] = field(default_factory=dict)       # site -> when it joined (ms)
    session: ServerSession | None = None
    cohort: tuple[str, ...] = ()
    expected: set[str] = field(default_factory=set)             # sites the open phase still waits for
    phase_deadline_ms: int = 0
    masked_keys: dict[str, tuple[str, str]] = field(default_factory=dict)  # idempotency key -> (site, update id)
    sessions: int = 0
    uplink: int = 0
    metric_names: dict[str, tuple[str, ...]] = field(default_factory=dict)  # site -> metric names its join listed
    layout: VectorLayout | None = None                                       # the live session's input layout

    @property
    def session_hex(self) -> str:
        return self.session.params.session_id.hex() if self.session is not None else ""

    @property
    def live(self) -> bool:
        return self.session is not None and self.session.phase not in (Phase.DONE, Phase.ABORTED)


class SecureRoundHost(Protocol):
    """What the coordinator needs from the round engine that hosts it: its lock (every coordinator method runs
    under it) and the condition waiters sleep on, its store, whether a site may take a task, the connected
    sites, byte accounting, and closing round ``rnd`` with the securely aggregated mean (or failing it when
    the strategy refuses that)."""

    lock: threading.RLock
    changed: threading.Condition
    blobs: BlobStore

    @property
    def store(self) -> Store: ...
    def eligible(self, task_id: str, spec: task_pb2.TaskSpec, site: str) -> bool: ...
    def connected_sites(self) -> Iterable[str]: ...
    def add_downlink(self, task_id: str, nbytes: int, *, site: str = "", wire_bytes: int = 0) -> None: ...
    def add_uplink(self, task_id: str, rnd: int, nbytes: int) -> None: ...
    def close_secure_round(self, task_id: str, rnd: int, mean: dict[str, np.ndarray], metrics: dict[str, float],
                           summary: str) -> None: ...


class SecureRounds:
    """The aggregator's secure-aggregation coordinator (one per engine)."""

    def __init__(self, host: SecureRoundHost) -> None:
        self.host = host
        self._rounds: dict[str, _Round] = {}
        self._features: dict[str, frozenset[str]] = {}
        self._outbox: dict[str, list[tuple[int, str, agent_pb2.WorkItem]]] = {}  # site -> (seq, task, item)
        self._seq = itertools.count(1)

    # capabilities and the work stream ---------------------------------------------------------------------
    def hello(self, site: str, features: list[str], secure_aggregation: bool) -> None:
        """Remember what ``site`` announced at Hello (it must say ``secagg-v2`` to be given secure tasks)."""
        with self.host.lock:
            self._features[site] = frozenset(features) | (frozenset({"secure_aggregation"}) if secure_aggregation
                                                          else frozenset())
        if secure_aggregation and FEATURE not in features:
            log.warning("agent speaks an older secure-aggregation protocol; it is given no secure task", site=site,
                        features=sorted(features), needs=FEATURE,
                        hint="upgrade the agent: secure aggregation now signs keys and the survivor set")

    def capable(self, site: str) -> bool:
        """Did ``site`` announce the ``secagg-v2`` feature and ``Capabilities.secure_aggregation``?"""
        return {FEATURE, "secure_aggregation"} <= self._features.get(site, frozenset())

    def pending(self, site: str, cursor: list[int]) -> list[agent_pb2.WorkItem]:
        """Phase messages for ``site`` newer than ``cursor[0]`` (one cursor per work stream; advanced here).

        Only the latest message per (site, task) is kept: each one is sent after the site answered the one
        before, so a reconnected agent needs only that one (it answers a repeat with its first answer), and a
        restarted agent, which lost its keys, gets nothing it could mistake for a session of its own."""
        with self.host.lock:
            items = [(seq, item) for seq, _, item in self._outbox.get(site, ()) if seq > cursor[0]]
            if items:
                cursor[0] = items[-1][0]
            return [item for _, item in items]

    def _send(self, st: _Round, site: str, **body: object) -> None:
        msg = agent_pb2.SecAggPhase(task_id=st.task_id, round=st.round, session_id=st.session_hex, **body)
        items = [i for i in self._outbox.get(site, ()) if i[1] != st.task_id]
        self._outbox[site] = [*items, (next(self._seq), st.task_id, agent_pb2.WorkItem(secagg=msg))]
        self.host.add_downlink(st.task_id, msg.ByteSize())

    def _clear_outbox(self, task_id: str) -> None:
        for site, items in list(self._outbox.items()):
            kept = [i for i in items if i[1] != task_id]
            if kept:
                self._outbox[site] = kept
            else:
                del self._outbox[site]

    # round bookkeeping -----------------------------------------------------------------------------------
    def _event(self, task_id: str, kind: str, message: str) -> None:
        with self.host.store.transaction() as tx:
            tx.add_event(task_id, kind, message)

    def _current(self, task_id: str, *, create: bool = True) -> tuple[_Round | None, RoundRecord | None, task_pb2.TaskSpec | None]:
        """The state of the task's open round attempt (dropping a stale one); (None, None, None) if none."""
        store = self.host.store
        st = self._rounds.get(task_id)
        task = store.task(task_id)
        rnd = store.open_round_of(task_id) if task is not None and task.state == S.TASK_STATE_RUNNING else None
        if rnd is None:
            if st is not None:
                self._drop(st, "the task or round ended")
            return None, None, None
        spec = task.spec
        if not spec.secure_aggregation.enabled:
            return None, None, None
        if st is not None and (st.round, st.attempt) != (rnd.round, rnd.attempt):
            self._drop(st, f"round {st.round} attempt {st.attempt} is over")
            st = None
        if st is None and create:
            manifest = store.model(rnd.base_model)
            assert manifest is not None
            names = tuple(sent_tensors(spec, manifest))  # what each assignment lists (under SAFL: layers + head)
            shapes = tuple(tuple(manifest.tensor(n).shape) for n in names)
            timeout_ms = int(spec.rounds.round_timeout_s * 1000)
            opened = rnd.deadline_ms - timeout_ms  # this attempt's opening (a retry moves the deadline)
            st = self._rounds[task_id] = _Round(
                task_id, rnd.round, rnd.attempt, rnd.base_model, names, shapes,
                sum(int(np.prod(s, dtype=np.int64)) for s in shapes), opened + int(JOIN_FRACTION * timeout_ms),
                max(MIN_WINDOW_MS, int(PHASE_FRACTION * timeout_ms)))
        return st, rnd, spec

    def _drop(self, st: _Round, reason: str) -> None:
        """Forget a round attempt; a live session is aborted and its cohort told (no rejoin)."""
        self._rounds.pop(st.task_id, None)
        self._clear_outbox(st.task_id)
        if st.live:
            assert st.session is not None
            st.session.abort(reason)
            for site in st.cohort:
                self._send(st, site, abort=agent_pb2.SecAggAbort(reason=reason, rejoin=False))
            log.info("secure-aggregation session dropped", task_id=st.task_id, round=st.round, reason=reason)

    def _abort(self, st: _Round, reason: str) -> None:
        """The session failed: tell its cohort, re-key with whoever joins again (fresh session)."""
        assert st.session is not None
        st.session.abort(reason)
        self._clear_outbox(st.task_id)
        for site in st.cohort:
            self._send(st, site, abort=agent_pb2.SecAggAbort(reason=reason, rejoin=True))
        st.joined = {s: t for s, t in st.joined.items() if s not in st.cohort}
        st.expected = set()
        st.join_deadline_ms = max(st.join_deadline_ms, now_ms() + st.window_ms)
        self._event(st.task_id, "secagg-aborted", f"round {st.round}: secure-aggregation session "
                                                   f"{st.session_hex[:16]} aborted: {reason}")
        log.warning("secure-aggregation session aborted", task_id=st.task_id, round=st.round, reason=reason)
        st.session, st.cohort = None, ()

    # agent -> aggregator -------------------------------------------------------------------------------
    def respond(self, site: str, msg: agent_pb2.SecAggPhase) -> None:
        """Handle one ``SecAggRespond`` call from ``site`` (the certificate's name); raises Refused."""
        kind = msg.WhichOneof("body")
        with self.host.lock:
            require_assignment(self.host.store, site, msg.task_id, msg.round, "answer secure aggregation for")
            st, rnd, spec = self._current(msg.task_id)
            if st is None or rnd.round != msg.round:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"round {msg.round} of task {msg.task_id} is not an open "
                                                     "secure-aggregation round; wait for the next assignment")
            a = self.host.store.assignment(msg.task_id, msg.round, site)
            if a is None or a.declined:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"site {site} is not a participant of round {msg.round} of task "
                                                   f"{msg.task_id}")
            st.uplink += msg.ByteSize()
            if kind == "join":
                self._join(st, rnd, spec, site, msg.join)
            elif kind in ("advertise_keys", "share_keys", "survivors_signature", "unmask_response"):
                self._phase_message(st, site, msg, kind)
            else:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"SecAggRespond takes join, advertise_keys, share_keys, "
                                                  f"survivors_signature or unmask_response, not "
                                                  f"{kind or 'an empty body'}")
            self._advance(st, rnd, spec)
            self.host.changed.notify_all()

    def _join(self, st: _Round, rnd: RoundRecord, spec: task_pb2.TaskSpec, site: str, j: agent_pb2.SecAggJoin) -> None:
        if j.model_hash != st.base_model:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"site {site} trained on model {j.model_hash[:12]}, but round "
                                                 f"{st.round} started from {st.base_model[:12]}")
        if j.attempt != st.attempt:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"attempt {j.attempt} of round {st.round} is over (now attempt "
                                                 f"{st.attempt}); wait for the new assignment")
        if j.vector_length != st.vector_length:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the update vector has {j.vector_length} values; this round's "
                                              f"tensors {list(st.names)[:4]} have {st.vector_length}")
        if site in st.cohort and st.live:
            return  # already in the running session (a repeated join)
        st.metric_names[site] = _metric_names(site, j)
        if site not in st.joined:
            st.joined[site] = now_ms()
            log.info("site joined secure aggregation", task_id=st.task_id, round=st.round, site=site,
                     joined=len(st.joined))

    def _phase_message(self, st: _Round, site: str, msg: agent_pb2.SecAggPhase, kind: str) -> None:
        s = st.session
        if s is None or msg.session_id != st.session_hex or not st.live:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"secure-aggregation session {msg.session_id[:16]} of round "
                                                 f"{st.round} is over (aborted, finished or re-keyed)")
        phase = {"advertise_keys": Phase.ADVERTISE, "share_keys": Phase.SHARE_KEYS,
                 "survivors_signature": Phase.CONSISTENCY, "unmask_response": Phase.UNMASK}[kind]
        if s.phase is not phase:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{kind} from {site} arrived in phase {s.phase.value} of session "
                                                 f"{st.session_hex[:16]}: that phase closed at its deadline")
        sid = s.params.session_id
        try:
            if kind == "advertise_keys":
                k = msg.advertise_keys
                if not k.HasField("keys_statement"):
                    raise SecAggProtocolError(f"the keys are not signed; this aggregator speaks {FEATURE} (signed "
                                              "keys): upgrade the agent")
                s.receive_advertise(AdvertiseKeys(sid, site, k.mask_public_key, k.encryption_public_key,
                                                  k.keys_statement.SerializeToString()))
            elif kind == "share_keys":
                s.receive_share_keys(ShareKeys(sid, site, dict(msg.share_keys.ciphertexts)))
            elif kind == "survivors_signature":
                s.receive_survivors_signature(SurvivorsSignature(
                    sid, site, msg.survivors_signature.statement.SerializeToString()))
            else:
                r = msg.unmask_response
                s.receive_unmask(UnmaskResponse(sid, site, dict(r.self_mask_shares), dict(r.mask_key_shares)))
        except (SecAggProtocolError, SecAggIntegrityError) as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{kind} from {site} rejected: {exc}") from None
        st.expected.discard(site)

    def declined(self, site: str, task_id: str, rnd: int) -> None:
        """``site`` declined round ``rnd`` (e.g. its own secure-aggregation checks refused): stop waiting for it."""
        with self.host.lock:
            st = self._rounds.get(task_id)
            if st is None or st.round != rnd:
                return
            st.expected.discard(site)
            if st.session is None:
                st.joined.pop(site, None)
            st, open_round, spec = self._current(task_id, create=False)
            if st is not None:
                self._advance(st, open_round, spec)

    # masked inputs (through SubmitUpdate) ----------------------------------------------------------------
    def existing_masked(self, site: str, h: agent_pb2.UpdateHeader) -> str | None:
        """The update id of an already folded masked input with this idempotency key (None if new)."""
        with self.host.lock:
            st = self._rounds.get(h.task_id)
            prior = st.masked_keys.get(h.idempotency_key) if st is not None else None
            if prior is None:
                return None
            if prior[0] != site:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, "this idempotency key belongs to another site's update")
            return prior[1]

    def check_masked_header(self, site: str, h: agent_pb2.UpdateHeader) -> int:
        """Validate a masked-input header before its bytes are read; returns the vector length."""
        with self.host.lock:
            st, rnd, _ = self._current(h.task_id)
            if st is None or rnd.round != h.round or st.session is None or h.secagg_session_id != st.session_hex:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"secure-aggregation session {h.secagg_session_id[:16]} of "
                                                     f"round {h.round} of task {h.task_id} is over; the masked "
                                                     "input was not used")
            s = st.session
            if s.phase is not Phase.MASKED_INPUT:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"masked input from {site} arrived in phase {s.phase.value}: "
                                                     "the masked-input phase is closed")
            if site not in st.expected:
                raise Refused(grpc.StatusCode.ALREADY_EXISTS if site in st.cohort else grpc.StatusCode.PERMISSION_DENIED,
                              f"site {site} already sent its masked input with another idempotency key, or did "
                              "not share keys in this session")
            if h.base_model_hash != st.base_model:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"the masked input was computed against model "
                                                     f"{h.base_model_hash[:12]}, not {st.base_model[:12]}")
            if h.num_samples or h.metrics or h.eval_metrics or h.HasField("dp"):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a masked input must not carry num_samples, metrics, "
                                                  "eval_metrics or dp: they would travel in the clear beside "
                                                  "the masked vector")
            ring, length = s.params.quantizer.dtype.name, s.params.vector_length
            if (len(h.tensors) != 1 or h.tensors[0].name != MASKED_TENSOR or h.tensors[0].dtype != ring
                    or list(h.tensors[0].shape) != [length]):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"a masked input carries exactly one tensor {MASKED_TENSOR!r}, "
                                                  f"{ring}, shape [{length}]")
            return length

    def accept_masked(self, site: str, h: agent_pb2.UpdateHeader, vector: np.ndarray, nbytes: int) -> str:
        """Fold a verified masked vector into the session; returns its update id (idempotent per key)."""
        with self.host.lock:
            prior = self.existing_masked(site, h)
            if prior is not None:
                return prior
            self.check_masked_header(site, h)  # the phase may have closed while the bytes streamed in
            st, rnd, spec = self._current(h.task_id)
            assert st is not None and st.session is not None
            failpoint("aggregator.secagg.masked-input")  # crash tests: a restart in the middle of a session
            try:
                st.session.receive_masked_input(MaskedInput(st.session.params.session_id, site, vector))
            except SecAggProtocolError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"masked input from {site} rejected: {exc}") from None
            update_id = f"m-{st.session_hex[:12]}-{site}"
            st.masked_keys[h.idempotency_key] = (site, update_id)
            st.expected.discard(site)
            st.uplink += nbytes
            log.info("masked input folded", task_id=h.task_id, round=h.round, site=site, nbytes=nbytes)
            self._advance(st, rnd, spec)
            self.host.changed.notify_all()
            return update_id

    # phases --------------------------------------------------------------------------------------------
    def tick(self) -> float:
        """Apply join and phase deadlines of every secure round; seconds until the next one (<= 1)."""
        wait = 1.0
        with self.host.lock:
            for task_id in list(self._rounds):
                st, rnd, spec = self._current(task_id, create=False)
                if st is None:
                    continue
                self._advance(st, rnd, spec)
                if task_id in self._rounds:
                    due = st.phase_deadline_ms if st.live else st.join_deadline_ms
                    wait = min(wait, max(0.0, (due - now_ms()) / 1000))
            for rnd in self.host.store.open_rounds(running_only=False):
                if rnd.task_id not in self._rounds:  # e.g. after a restart: wait for joins with a fresh state
                    self._current(rnd.task_id)
        return max(wait, 0.01)

    def _maybe_start(self, st: _Round, rnd: RoundRecord, spec: task_pb2.TaskSpec) -> None:
        floor = floor_of(spec)
        n, now = len(st.joined), now_ms()
        if n < floor or st.sessions >= MAX_SESSIONS_PER_ATTEMPT:
            return
        if n < rnd.sites_target and now < st.join_deadline_ms and self._others_may_join(st, spec):
            return
        cohort = tuple(sorted(st.joined, key=lambda s: (st.joined[s], s)))
        cfg = spec.secure_aggregation
        if cfg.threshold and not cfg.degree:
            cohort = cohort[:2 * cfg.threshold - 1]  # complete graph: 2t > n keeps the threshold safe
        nonce = os.urandom(16)  # fresh per session; also seeds a top-k task's shared index set
        try:
            layout = _session_layout(st, spec, cohort, index_seed(st.task_id, st.round, bytes.fromhex(st.base_model),
                                                                  nonce))
            params = session_params(spec, task_id=st.task_id, round_number=st.round, cohort=cohort,
                                    model_hash_hex=st.base_model, vector_length=layout.length, nonce=nonce,
                                    quantizer=layout.quantizer, layout_digest=layout.digest())
            session = ServerSession(params, min_cohort=floor)
        except SecAggConfigError as exc:
            st.sessions = MAX_SESSIONS_PER_ATTEMPT  # the same cohort would fail again; the deadline decides
            self._event(st.task_id, "secagg-refused", f"round {st.round}: no secure-aggregation session for "
                                                      f"{len(cohort)} sites: {exc}")
            return
        st.session, st.cohort, st.sessions, st.layout = session, params.cohort, st.sessions + 1, layout
        st.expected, st.phase_deadline_ms = set(params.cohort), now + st.window_ms
        q = params.quantizer
        setup = agent_pb2.SecAggSetup(
            cohort=list(params.cohort), threshold=params.threshold, degree=params.degree or 0, clip=q.clip,
            bits=q.bits, rounding=q.rounding, vector_length=params.vector_length, tensor_order=list(st.names),
            model_hash=st.base_model, nonce=params.nonce, attempt=st.attempt, **_setup_fields(layout))
        self._clear_outbox(st.task_id)
        for site in params.cohort:
            self._send(st, site, setup=setup)
        for site in set(st.joined) - set(params.cohort):
            self._send(st, site, abort=agent_pb2.SecAggAbort(reason="the cohort of this session is full", rejoin=False))
        self._event(st.task_id, "secagg-session",
                    f"round {st.round}: secure-aggregation session {st.session_hex[:16]} with {len(params.cohort)} "
                    f"site(s) ({', '.join(params.cohort)}), threshold {params.threshold} of {params.holders} "
                    f"holders, {params.vector_length} values, {q.bits}-bit quantization over +-{q.clip:g} in a "
                    f"{q.ring_bits}-bit ring" + (f", weights up to {q.weight_cap}" if q.weight_cap > 1 else "")
                    + (f", metrics {', '.join(layout.metric_names)}" if layout.metric_names else "")
                    + (", per-tensor weights" if layout.per_tensor_counts else "")
                    + (f", a shared random {layout.sent_values} of {layout.values} coordinates (top-k fraction "
                       f"{layout.index_fraction:g})" if layout.sparse else "") + distributed_dp.describe(layout))
        log.info("secure-aggregation session started", task_id=st.task_id, round=st.round,
                 session=st.session_hex[:16], cohort=list(params.cohort))

    def _others_may_join(self, st: _Round, spec: task_pb2.TaskSpec) -> bool:
        host = self.host
        assigned = {a.site for a in host.store.assignments_of(st.task_id, st.round) if not a.declined}
        if assigned - set(st.joined):
            return True
        return any(s not in assigned and host.eligible(st.task_id, spec, s) for s in host.connected_sites())

    def _advance(self, st: _Round, rnd: RoundRecord, spec: task_pb2.TaskSpec) -> None:
        """Start a session when the joins allow; close the open phase when all answered or its deadline passed."""
        if st.session is None:
            self._maybe_start(st, rnd, spec)
            return
        s, now = st.session, now_ms()
        if not st.live or (st.expected and now < st.phase_deadline_ms):
            return
        missing = sorted(st.expected)
        try:
            if s.phase is Phase.ADVERTISE:
                failpoint("aggregator.secagg.advertised")  # kill campaign: between secure-aggregation phases
                directory = s.close_advertise()
                entries = [agent_pb2.SecAggKeyEntry(site_id=e.sender, mask_public_key=e.mask_public_key,
                                                    encryption_public_key=e.encryption_public_key,
                                                    keys_statement=task_pb2.SignedStatement.FromString(e.attestation))
                           for e in directory.entries]
                for site in directory.members:
                    self._send(st, site, key_directory=agent_pb2.SecAggKeyDirectory(entries=entries))
                st.expected = set(directory.members)
                done = f"{len(directory.members)} site(s) advertised keys"
            elif s.phase is Phase.SHARE_KEYS:
                requests = s.close_share_keys()
                for site, req in requests.items():
                    self._send(st, site, masked_input_request=agent_pb2.SecAggMaskedInputRequest(
                        alive=list(req.alive), ciphertexts=dict(req.ciphertexts)))
                st.expected = set(requests)
                done = f"{len(requests)} site(s) shared keys"
            elif s.phase is Phase.MASKED_INPUT:
                surv = s.close_masked_input()
                for site in surv.survivors:
                    self._send(st, site, survivors_request=agent_pb2.SecAggSurvivors(survivors=list(surv.survivors)))
                st.expected = set(surv.survivors)
                done = f"{len(surv.survivors)} masked input(s) arrived"
            elif s.phase is Phase.CONSISTENCY:
                req = s.close_consistency()
                signatures = {u: task_pb2.SignedStatement.FromString(a) for u, a in req.signatures.items()}
                for site in req.signatures:
                    self._send(st, site, unmask_request=agent_pb2.SecAggUnmaskRequest(
                        survivors=list(req.survivors), dropped=list(req.dropped), model_hash=st.base_model,
                        survivor_signatures=signatures))
                st.expected = set(req.signatures)
                done = (f"{len(req.signatures)} of {len(req.survivors)} survivor(s) signed the survivor set"
                        + (f"; dropped after sharing keys: {', '.join(req.dropped)}" if req.dropped else ""))
            else:
                self._finish(st, s.finish())
                return
        except (SecAggAbort, SecAggIntegrityError) as exc:
            self._abort(st, str(exc))
            return
        except SecAggError as exc:  # a protocol bug on our side: abandon the session, keep the round
            log.exception("secure-aggregation phase failed", task_id=st.task_id, round=st.round)
            self._abort(st, f"internal error: {exc}")
            return
        st.phase_deadline_ms = now + st.window_ms
        self._event(st.task_id, "secagg-phase", f"round {st.round}, session {st.session_hex[:16]}: {done}"
                    + (f" (silent at the deadline: {', '.join(missing)})" if missing else ""))

    def _finish(self, st: _Round, result: AggregateResult) -> None:
        failpoint("aggregator.secagg.unmasked")  # kill campaign: sum unmasked, round not closed
        m = len(result.survivors)
        assert st.layout is not None
        tensors, metrics = _decode(st, result)
        dropped = [s for s in st.cohort if s not in result.survivors]
        metrics.update({"secagg_survivors": float(m), "secagg_cohort": float(len(st.cohort)),
                        "secagg_sessions": float(st.sessions)})
        task = self.host.store.task(st.task_id)
        if task is not None:  # distributed DP: the accountant's epsilon over the survivors' noise shares
            metrics.update(distributed_dp.round_metrics(self.host.store, task.spec, st.task_id, st.round, st.layout, m))
        with self.host.store.transaction() as tx:  # published for `fedclinic task verify`: the sum and who is in it
            tx.record_secure_sum(st.task_id, st.round, list(result.survivors),
                                 self.host.blobs.put(np.ascontiguousarray(
                                     result.quantized_sum, st.layout.quantizer.dtype.newbyteorder("<")).tobytes()),
                                 json.dumps({"session": st.session_hex, "names": list(st.names),
                                             "shapes": [list(x) for x in st.shapes], "cohort": len(st.cohort),
                                             "metric_names": list(st.layout.metric_names),
                                             "index_seed": st.layout.index_seed.hex()}))
        self._rounds.pop(st.task_id, None)
        self._clear_outbox(st.task_id)
        self.host.add_uplink(st.task_id, st.round, st.uplink)
        self._event(st.task_id, "secagg-result",
                    f"round {st.round}: unmasked the sum of {m} site(s) ({', '.join(result.survivors)})"
                    + (f"; dropped: {', '.join(dropped)}" if dropped else "")
                    + f"; per-value error bound of the mean {metrics['secagg_error_bound']:.3g}")
        log.info("secure aggregation finished", task_id=st.task_id, round=st.round, survivors=m,
                 dropped=dropped)
        self.host.close_secure_round(st.task_id, st.round, tensors, metrics,
                                       f"the secure sum of {m} site(s)")



def _metric_names(site: str, j: agent_pb2.SecAggJoin) -> tuple[str, ...]:
    """The evaluation-metric names a join lists (bounded: count and length)."""
    names = tuple(sorted(set(j.metric_names)))
    if len(names) > MAX_METRICS or any(not n or len(n) > MAX_METRIC_NAME for n in names):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"site {site} lists {len(names)} evaluation metric names; a "
                                                        f"join lists at most {MAX_METRICS}, each 1-{MAX_METRIC_NAME} "
                                                        "characters")
    return names


def _session_layout(st: _Round, spec: task_pb2.TaskSpec, cohort: tuple[str, ...], seed: bytes) -> VectorLayout:
    """The input layout of a session over ``cohort``: the metric names any member has, the narrowest ring, and
    (top-k tasks) the shared index set drawn from ``seed``."""
    names = sorted({n for site in cohort for n in st.metric_names.get(site, ())})[:MAX_METRICS]
    return layout_for(spec, st.names, st.shapes, len(cohort), tuple(names), index_seed=seed)


def _setup_fields(layout: VectorLayout) -> dict[str, object]:
    """The layout's fields of ``SecAggSetup``."""
    q = layout.quantizer
    return {"ring_bits": q.ring_bits, "weight_cap": q.weight_cap, "metric_names": list(layout.metric_names),
            "metric_clip": layout.metric_clip, "per_tensor_counts": layout.per_tensor_counts,
            "metric_bits": layout.metric_bits, "index_fraction": layout.index_fraction if layout.sparse else 0.0,
            **distributed_dp.setup_fields(layout)}


def _decode(st: _Round, result: AggregateResult) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The round's mean delta per tensor (those some survivor sent) and its metrics from the unmasked sum."""
    assert st.layout is not None
    decoded = st.layout.decode(result.quantized_sum)
    shapes = dict(zip(st.names, st.shapes))
    tensors = {name: mean.reshape(shapes[name]) for name, mean in decoded.tensors.items()}
    metrics = {f"eval_{k}": v for k, v in decoded.metrics.items()}
    metrics["secagg_error_bound"] = st.layout.error_bound()  # per value, on the weighted mean
    if decoded.metrics:
        metrics["secagg_metric_error_bound"] = st.layout.metric_error_bound()
    metrics["secagg_ring_bits"] = float(st.layout.quantizer.ring_bits)
    if decoded.tensor_weights:
        metrics["secagg_total_weight"] = float(max(decoded.tensor_weights.values()))
    return tensors, metrics
