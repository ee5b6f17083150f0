"""The aggregator's Prometheus metrics, in a registry of its own (served by fedclinic.runtime.metrics_endpoint).

Counters and histograms are updated where things happen: task and round lifecycle from the store's committed
events (``on_commit``: counted only once the change is durable), bytes and updates from the engine, update
outcomes and timings from ``AgentApi.SubmitUpdate``, call refusals from the auth interceptor. Gauges are read
from the store (and the engine's connection table) at each scrape, so they are never stale.

Counters (``_total``) and histograms, prefix ``fedclinic_aggregator_``:

- ``tasks_submitted_total``; ``tasks_ended_total{state}`` (completed | failed | cancelled: failed counts
  tasks that missed quorum for good or whose aggregation failed)
- ``rounds_opened_total{task_id}``; ``rounds_closed_total{task_id}``; ``round_quorum_misses_total{task_id}``
  (a deadline passed short of ``min_sites`` and the round was reopened); ``site_declines_total{task_id}`` (a
  round, or the final evaluation phase, declined by a site)
- ``round_duration_seconds`` (histogram): from a round's opening to its closing, retries included
- ``updates_received_total{task_id}``: updates stored and folded (plain and secure-aggregation masked inputs)
- ``site_updates_received_total{site}``: the same per sending site
- ``updates_refused_total{reason}``: SubmitUpdate calls that ended without a receipt; ``reason`` is the gRPC
  status code in lower case (invalid_argument: verification, codec or strategy refused it;
  failed_precondition: round closed or task ended; permission_denied: not a participant; ...), or
  ``interrupted`` when the stream broke before any status was set
- ``updates_duplicate_total``: retried uploads acknowledged again (nothing stored twice)
- ``update_processing_seconds{outcome}`` (histogram): SubmitUpdate from first message to receipt or error;
  ``outcome`` is accepted, duplicate or one of the refusal reasons above
- ``uplink_payload_bytes_total{task_id}``: update tensor payloads as sent (encoded), the sum of the rounds'
  ``uplink_bytes``; ``uplink_wire_bytes_total{task_id}``: the serialized SubmitUpdate messages (plain updates)
- ``downlink_bytes_total{task_id}``: bytes served to agents (model tensors and files, secure-aggregation
  phase messages), the sum of the rounds' ``downlink_bytes`` for what was sent while its round was open
- ``control_download_bytes_total``: models downloaded through the control API (data scientists)
- ``auth_refusals_total{reason}``: calls refused by the auth interceptor: no_certificate | revoked | role
- ``limit_refusals_total{limit}``: calls refused or ended by a per-peer limit (aggregator_service.peer_limits):
  concurrency (per-certificate calls of one class) | long_lived (all peers' streams and transfers) | field (a
  field over its length limit) | idle (a client stream ended by the idle timeout)

Gauges, read at scrape time:

- ``connected_agents``: sites with a work stream open now
- ``tasks{state}``: tasks by state (queued, running, completed, failed, cancelled)
- ``open_rounds`` (of running tasks); ``pending_updates`` (received in open rounds, waiting for the round to close);
  ``outstanding_assignments`` (sites assigned to an open round that have not reported or declined)
- ``privacy_epsilon{task_id, level}``: the privacy spent up to the task's last closed round: ``client`` =
  the aggregator's own client-level DP accountant (dp-fedavg), ``sample`` = the largest cumulative spend a
  site reported (DP-SGD at the sites), ``distributed`` = the accountant over the sites' noise shares (distributed DP)

Cardinality: ``reason``, ``outcome`` and ``state`` take a fixed set of values; ``site`` only names that hold
an agent certificate of the federation's CA; ``task_id`` is bounded by fedclinic.runtime.metrics_endpoint.TaskSeries
(running tasks plus the last ``KEEP_ENDED_TASKS`` ended ones). A task id from an unauthenticated or refused
request never becomes a label.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fedclinic.runtime.metrics_endpoint import TaskSeries
from fedclinic.proto import control_pb2

from aggregator_service.store import Store

S = control_pb2
P = "fedclinic_aggregator_"
#: ended tasks whose task_id-labelled series stay visible (fedclinic.runtime.metrics_endpoint.TaskSeries)
KEEP_ENDED_TASKS = 20
_ENDED_EVENTS = {"completed": "completed", "failed": "failed", "cancelled": "cancelled"}
_ROUND_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, float("inf"))
_UPDATE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))
_TASK_STATES = {S.TASK_STATE_QUEUED: "queued", S.TASK_STATE_RUNNING: "running", S.TASK_STATE_COMPLETED: "completed",
                S.TASK_STATE_FAILED: "failed", S.TASK_STATE_CANCELLED: "cancelled"}


class StateSource(Protocol):
    """What the gauges are read from at scrape time (the round engine)."""

    @property
    def store(self) -> Store: ...

    def connected_count(self) -> int:
        """How many distinct sites have a work stream open now."""


class AggregatorMetrics:
    """Every metric of one aggregator (see the module docstring), in ``self.registry``."""

    def __init__(self, registry: CollectorRegistry | None = None, *, keep_ended_tasks: int = KEEP_ENDED_TASKS) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.series = TaskSeries(keep_ended_tasks)
        self.tasks_submitted = Counter(P + "tasks_submitted", "Tasks submitted and stored", registry=r)
        self.tasks_ended = Counter(P + "tasks_ended", "Tasks that reached a final state", ["state"], registry=r)
        self.rounds_opened = Counter(P + "rounds_opened", "Rounds opened", ["task_id"], registry=r)
        self.rounds_closed = Counter(P + "rounds_closed", "Rounds closed with a new global model", ["task_id"],
                                     registry=r)
        self.quorum_misses = Counter(P + "round_quorum_misses", "Round deadlines passed short of min_sites, round "
                                     "reopened", ["task_id"], registry=r)
        self.site_declines = Counter(P + "site_declines", "Rounds a site declined", ["task_id"], registry=r)
        self.round_duration = Histogram(P + "round_duration_seconds", "Round opening to closing, retries included",
                                        buckets=_ROUND_BUCKETS, registry=r)
        self.updates_received = Counter(P + "updates_received", "Updates stored and folded (plain and masked)",
                                        ["task_id"], registry=r)
        self.site_updates = Counter(P + "site_updates_received", "Updates stored and folded, by sending site",
                                    ["site"], registry=r)
        self.updates_refused = Counter(P + "updates_refused", "SubmitUpdate calls ended without a receipt",
                                       ["reason"], registry=r)
        self.updates_duplicate = Counter(P + "updates_duplicate", "Retried uploads acknowledged again", registry=r)
        self.update_seconds = Histogram(P + "update_processing_seconds", "SubmitUpdate from first message to answer",
                                        ["outcome"], buckets=_UPDATE_BUCKETS, registry=r)
        self.uplink_payload = Counter(P + "uplink_payload_bytes", "Update tensor payload bytes as sent (encoded)",
                                      ["task_id"], registry=r)
        self.uplink_wire = Counter(P + "uplink_wire_bytes", "Serialized SubmitUpdate message bytes", ["task_id"],
                                   registry=r)
        self.downlink = Counter(P + "downlink_bytes", "Bytes served to agents (models, secure-aggregation phases)",
                                ["task_id"], registry=r)
        self.control_download = Counter(P + "control_download_bytes", "Model bytes downloaded via the control API",
                                        registry=r)
        self.auth_refusals = Counter(P + "auth_refusals", "Calls refused by the auth interceptor", ["reason"],
                                     registry=r)
        self.limit_refusals = Counter(P + "limit_refusals", "Calls refused or ended by a per-peer limit", ["limit"],
                                      registry=r)
        self._engine: StateSource | None = None
        r.register(_StateCollector(self))

    def attach(self, engine: StateSource) -> None:
        """Read gauges from ``engine`` (its store and connection table) at scrape time."""
        self._engine = engine

    # hooks --------------------------------------------------------------------------------------------------
    def on_commit(self, events: list[dict[str, Any]]) -> None:
        """Store.on_commit: count the lifecycle events of one committed transaction."""
        for e in events:
            kind, task_id = e["kind"], e["task_id"]
            if kind == "submitted":
                self.tasks_submitted.inc()
            elif kind == "round-opened":
                self.series.labels(self.rounds_opened, task_id).inc()
            elif kind == "round-closed":
                self.series.labels(self.rounds_closed, task_id).inc()
                duration = self._round_seconds(task_id, e["details"].get("round"))
                if duration is not None:
                    self.round_duration.observe(duration)
            elif kind == "round-failed":
                self.series.labels(self.quorum_misses, task_id).inc()
            elif kind == "declined":
                self.series.labels(self.site_declines, task_id).inc()
            elif kind in _ENDED_EVENTS:
                self.tasks_ended.labels(_ENDED_EVENTS[kind]).inc()
                self.series.ended(task_id)

    def update_stored(self, task_id: str, site: str, payload_bytes: int, wire_bytes: int = 0) -> None:
        """A plain update is durable and folded (``wire_bytes`` 0 for masked inputs, counted in ``uplink``)."""
        self.series.labels(self.updates_received, task_id).inc()
        self.site_updates.labels(site).inc()
        if payload_bytes:
            self.series.labels(self.uplink_payload, task_id).inc(payload_bytes)
        if wire_bytes:
            self.series.labels(self.uplink_wire, task_id).inc(wire_bytes)

    def masked_input_stored(self, task_id: str, site: str) -> None:
        """A secure-aggregation masked input was folded (its bytes arrive with ``uplink`` at the session's end)."""
        self.series.labels(self.updates_received, task_id).inc()
        self.site_updates.labels(site).inc()

    def uplink(self, task_id: str, nbytes: int) -> None:
        """Bytes added to a round's uplink outside plain updates (a secure-aggregation session's total)."""
        self.series.labels(self.uplink_payload, task_id).inc(nbytes)

    def downlink_sent(self, task_id: str, nbytes: int) -> None:
        self.series.labels(self.downlink, task_id).inc(nbytes)

    def update_answered(self, outcome: str, seconds: float) -> None:
        """One SubmitUpdate call ended: ``outcome`` accepted, duplicate or a refusal reason (lower-case code)."""
        if outcome == "duplicate":
            self.updates_duplicate.inc()
        elif outcome != "accepted":
            self.updates_refused.labels(outcome).inc()
        self.update_seconds.labels(outcome).observe(seconds)

    def call_refused(self, reason: str) -> None:
        self.auth_refusals.labels(reason).inc()

    def limit_refused(self, limit: str) -> None:
        """A call refused or ended by a per-peer limit (``limit``: concurrency | long_lived | field | idle)."""
        self.limit_refusals.labels(limit).inc()

    # scrape-time state ----------------------------------------------------------------------------------------
    def _round_seconds(self, task_id: str, rnd: Any) -> float | None:
        if self._engine is None or not isinstance(rnd, int):
            return None
        row = self._engine.store.round(task_id, rnd)
        return None if row is None or not row.closed_ms else max(0.0, (row.closed_ms - row.opened_ms) / 1000)


class _StateCollector(Collector):
    """The gauges of the module docstring, computed from the store at each scrape."""

    def __init__(self, metrics: AggregatorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        engine = self.metrics._engine
        if engine is None:
            return
        store = engine.store
        yield GaugeMetricFamily(P + "connected_agents", "Sites with a work stream open now",
                                value=engine.connected_count())
        gauges = store.gauges()
        tasks = GaugeMetricFamily(P + "tasks", "Tasks by state", labels=["state"])
        for state, name in _TASK_STATES.items():
            tasks.add_metric([name], gauges.tasks_by_state.get(state, 0))
        yield tasks
        yield GaugeMetricFamily(P + "open_rounds", "Rounds open now", value=gauges.open_rounds)
        yield GaugeMetricFamily(P + "pending_updates", "Updates received in open rounds, waiting for them to close",
                                value=gauges.pending_updates)
        yield GaugeMetricFamily(
            P + "outstanding_assignments", "Sites assigned to an open round that have not reported or declined",
            value=gauges.outstanding_assignments)
        privacy = GaugeMetricFamily(P + "privacy_epsilon", "Privacy spent up to the task's last closed round "
                                    "(client: aggregator accountant; sample: largest site spend)",
                                    labels=["task_id", "level"])
        running = {t.task_id for t in store.tasks(S.TASK_STATE_RUNNING)}
        for task_id in sorted(running | self.metrics.series.tracked()):
            row = store.last_closed_round(task_id)
            figures = row.metrics if row is not None else {}
            for key, level in (("client_dp_epsilon", "client"), ("dp_epsilon", "sample"),
                               ("ddp_epsilon", "distributed")):
                if key in figures:
                    privacy.add_metric([task_id, level], figures[key])
        yield privacy
