"""The agent's Prometheus metrics, in a registry of its own (served by fedclinic.runtime.metrics_endpoint when the agent
config sets ``metrics_address``; nothing is ever pushed: no telemetry leaves the site unless a scraper the site
runs reads it).

Counters (``_total``) and histograms, updated by hooks in hospital_agent.worker; prefix ``fedclinic_agent_``:

- ``rounds_trained_total{task_id}``: local training runs finished (one per round the site took part in)
- ``training_seconds`` (histogram): wall time of one local training run
- ``updates_sent_total{task_id}``: upload attempts (SubmitUpdate calls started, resends included)
- ``updates_acknowledged_total{task_id}``: uploads the aggregator acknowledged (a receipt, duplicates included)
- ``updates_refused_total{reason}``: uploads the aggregator refused; ``reason`` is the gRPC status code in
  lower case (the update is dropped, see the log for the message)
- ``upload_interruptions_total``: uploads cut by the network or a stop; the update stays in the outbox
- ``transfers_resumed_total{direction}``: model fetches (``fetch``) and uploads (``upload``) continued from the
  last verified chunk after a cut connection, instead of from their first byte
- ``update_payload_bytes_sent_total{task_id}``: tensor payload bytes of acknowledged, first-time updates
  (encoded as sent: the aggregator's ``uplink_bytes`` for this site); ``update_wire_bytes_sent_total{task_id}``:
  the serialized SubmitUpdate messages of those uploads, with gRPC's 5-byte message prefixes
- ``model_bytes_received_total{task_id}``: model tensor and file bytes fetched (cached tensors are not fetched)
- ``policy_refusals_total{reason}``: assignments this site refused: ``spec`` (the task spec fails
  fedclinic.spec.validation), ``policy`` (site policy), ``privacy_budget``
  (admission or a round's charge refused by the privacy ledger), ``rejected`` (manual approval said no),
  ``data`` (the dataset does not meet the task's data contract), ``error`` (another error; see the log)

Gauges, read at scrape time:

- ``aggregator_connected``: 1 while the work stream's Hello succeeded and the stream has not failed since
- ``outbox_depth``: updates written and not yet acknowledged
- ``tasks_awaiting_approval``: tasks held under ``approval = "manual"``
- ``privacy_epsilon_spent{dataset}``, ``privacy_epsilon_committed{dataset}`` (spent + what running tasks may
  still spend) and ``privacy_epsilon_budget{dataset}``: the site's privacy ledger (hospital_agent.privacy_ledger)

Cardinality: ``reason`` takes a fixed set of values, ``dataset`` the datasets of the site configuration, and
``task_id`` is bounded by fedclinic.runtime.metrics_endpoint.TaskSeries (tasks seen recently: the last
``KEEP_TASKS``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fedclinic.runtime.metrics_endpoint import TaskSeries
from hospital_agent.outbox import Outbox
from hospital_agent.privacy_ledger import PrivacyLedger

P = "fedclinic_agent_"
#: tasks whose task_id-labelled series stay visible; the agent does not learn when a task ends, so every
#: task counts as ended once it has been trained (fedclinic.runtime.metrics_endpoint.TaskSeries)
KEEP_TASKS = 20
_TRAIN_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, float("inf"))
REFUSAL_REASONS = ("policy", "privacy_budget", "rejected", "data", "signature", "error")
GRPC_MESSAGE_PREFIX = 5  # bytes gRPC puts before each message (compressed flag + length)


def count_wire_bytes(messages: Iterable[bytes], total: list[int]) -> Iterator[bytes]:
    """Pass serialized messages through, adding each one's size on the wire (with gRPC's message prefix) to
    ``total[0]``: the same sum the aggregator records as an update's ``wire_bytes``."""
    for message in messages:
        total[0] += len(message) + GRPC_MESSAGE_PREFIX
        yield message


class AgentMetrics:
    """Every metric of one agent (see the module docstring), in ``self.registry``; gauges read ``outbox``,
    ``ledger`` and ``awaiting_approval()`` at scrape time."""

    def __init__(self, outbox: Outbox, ledger: PrivacyLedger, awaiting_approval: Callable[[], int],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.series = TaskSeries(KEEP_TASKS)
        self.rounds_trained = Counter(P + "rounds_trained", "Local training runs finished", ["task_id"], registry=r)
        self.training_seconds = Histogram(P + "training_seconds", "Wall time of one local training run",
                                          buckets=_TRAIN_BUCKETS, registry=r)
        self.updates_sent = Counter(P + "updates_sent", "Upload attempts (SubmitUpdate calls started)", ["task_id"],
                                    registry=r)
        self.updates_acknowledged = Counter(P + "updates_acknowledged", "Uploads acknowledged with a receipt",
                                            ["task_id"], registry=r)
        self.updates_refused = Counter(P + "updates_refused", "Uploads refused by the aggregator", ["reason"],
                                       registry=r)
        self.upload_interruptions = Counter(P + "upload_interruptions", "Uploads cut short; kept in the outbox",
                                            registry=r)
        self.transfers_resumed = Counter(P + "transfers_resumed", "Transfers continued from the last verified chunk",
                                         ["direction"], registry=r)
        self.payload_sent = Counter(P + "update_payload_bytes_sent", "Tensor payload bytes of acknowledged updates",
                                    ["task_id"], registry=r)
        self.wire_sent = Counter(P + "update_wire_bytes_sent", "SubmitUpdate message bytes of acknowledged updates",
                                 ["task_id"], registry=r)
        self.model_received = Counter(P + "model_bytes_received", "Model tensor and file bytes fetched", ["task_id"],
                                      registry=r)
        self.policy_refusals = Counter(P + "policy_refusals", "Assignments this site refused", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.policy_refusals.labels(reason)  # present at 0, so alerts on increase() work from the start
        self.connected = False
        r.register(_StateCollector(self, outbox, ledger, awaiting_approval))

    def trained(self, task_id: str, seconds: float) -> None:
        self.series.labels(self.rounds_trained, task_id).inc()
        self.training_seconds.observe(seconds)
        self.series.ended(task_id)  # keep at most KEEP_TASKS tasks' series, the most recently trained

    def upload_started(self, task_id: str) -> None:
        self.series.labels(self.updates_sent, task_id).inc()

    def acknowledged(self, task_id: str, duplicate: bool, payload_bytes: int, wire_bytes: int) -> None:
        """A receipt came back; bytes count once per update (a duplicate's were counted when first stored)."""
        self.series.labels(self.updates_acknowledged, task_id).inc()
        if not duplicate:
            self.series.labels(self.payload_sent, task_id).inc(payload_bytes)
            self.series.labels(self.wire_sent, task_id).inc(wire_bytes)

    def refused(self, code_name: str) -> None:
        self.updates_refused.labels(code_name.lower()).inc()

    def fetched(self, task_id: str, nbytes: int) -> None:
        self.series.labels(self.model_received, task_id).inc(nbytes)

    def fetch_resumed(self, task_id: str) -> None:
        """A cut model fetch is asked to continue from its last verified chunk."""
        self.transfers_resumed.labels("fetch").inc()

    def upload_resumed(self, task_id: str) -> None:
        """A cut upload continues from the bytes the aggregator holds verified."""
        self.transfers_resumed.labels("upload").inc()

    def assignment_refused(self, reason: str) -> None:
        """``reason``: one of REFUSAL_REASONS."""
        self.policy_refusals.labels(reason if reason in REFUSAL_REASONS else "error").inc()


class _StateCollector(Collector):
    def __init__(self, metrics: AgentMetrics, outbox: Outbox, ledger: PrivacyLedger,
                 awaiting_approval: Callable[[], int]) -> None:
        self.metrics, self.outbox, self.ledger, self.awaiting_approval = metrics, outbox, ledger, awaiting_approval

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(P + "aggregator_connected", "1 while the work stream to the aggregator is up",
                                value=1.0 if self.metrics.connected else 0.0)
        yield GaugeMetricFamily(P + "outbox_depth", "Updates written and not yet acknowledged",
                                value=self.outbox.count())
        yield GaugeMetricFamily(P + "tasks_awaiting_approval", "Tasks held for manual approval",
                                value=self.awaiting_approval())
        spent = GaugeMetricFamily(P + "privacy_epsilon_spent", "Epsilon that has left the site, per dataset",
                                  labels=["dataset"])
        committed = GaugeMetricFamily(P + "privacy_epsilon_committed", "Spent epsilon plus what running tasks may "
                                      "still spend, per dataset", labels=["dataset"])
        budget = GaugeMetricFamily(P + "privacy_epsilon_budget", "The dataset's privacy budget (epsilon)",
                                   labels=["dataset"])
        for d in self.ledger.status():
            spent.add_metric([d.dataset], d.spent_epsilon)
            committed.add_metric([d.dataset], d.committed_epsilon)
            if d.budget is not None:
                budget.add_metric([d.dataset], d.budget.epsilon)
        yield spent
        yield committed
        yield budget
