"""Metrics: the endpoint's address (clear errors from config file, environment and command line), the HTTP
endpoint itself, bounded task labels, and the state gauges read from a real store, engine and privacy ledger."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aggregator_service import cli as aggregator_cli
from aggregator_service.config import AggregatorConfig
from aggregator_service.engine import Engine
from aggregator_service.metrics import AggregatorMetrics
from aggregator_service.store import SqliteStore
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.errors import ConfigError
from fedclinic.runtime.metrics_endpoint import MetricsAddress, MetricsServer, TaskSeries, parse_metrics_address
from fedclinic.transport.package import ModelPackage, raw_bytes
from fedclinic.spec.task import Task
from hospital_agent import cli as agent_cli
from hospital_agent.config import AgentConfig
from hospital_agent.metrics import AgentMetrics
from hospital_agent.outbox import Outbox
from hospital_agent.privacy_ledger import PrivacyLedger

AGGREGATOR_TOML = """listen = "127.0.0.1:0"
state_dir = "state"
{extra}
[tls]
cert = "a.crt"
key = "a.key"
ca = "ca.crt"
"""

AGENT_TOML = """aggregator = "127.0.0.1:7443"
work_dir = "work"
{extra}
[tls]
cert = "s.crt"
key = "s.key"
ca = "ca.crt"
"""


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9464", MetricsAddress("127.0.0.1", 9464)),
    ("[::1]:0", MetricsAddress("::1", 0)),
    ("localhost:9465", MetricsAddress("localhost", 9465)),
    ("0.0.0.0:9464", MetricsAddress("0.0.0.0", 9464)),
    ("", None),
    (None, None),
])
def test_metrics_addresses_that_parse(text, expected):
    assert parse_metrics_address(text, "agent.toml") == expected


@pytest.mark.parametrize("text, says", [
    ("9464", "is not HOST:PORT"),
    ("127.0.0.1:", "port must be a number from 0 to 65535"),
    ("127.0.0.1:70000", "port must be a number from 0 to 65535"),
    ("metrics.example.org:9464", "is not an IP address"),
    ("::1:9464", "IPv6 address in brackets"),
    (9464, "must be a string"),
])
def test_bad_metrics_addresses_say_what_to_write(text, says):
    with pytest.raises(ConfigError, match=says) as exc:
        parse_metrics_address(text, "agent.toml")
    assert str(exc.value).startswith("agent.toml: ")


def test_loopback_is_told_apart():
    assert parse_metrics_address("127.0.0.1:1", "x").loopback and parse_metrics_address("[::1]:1", "x").loopback
    assert not parse_metrics_address("0.0.0.0:1", "x").loopback


def test_service_configs_read_metrics_address_and_refuse_bad_ones(tmp_path, monkeypatch):
    agg, agent = tmp_path / "aggregator.toml", tmp_path / "agent.toml"
    agg.write_text(AGGREGATOR_TOML.format(extra=""))
    agent.write_text(AGENT_TOML.format(extra=""))
    assert AggregatorConfig.load(agg).metrics_address is None  # off unless configured
    assert AgentConfig.load(agent).metrics_address is None
    agg.write_text(AGGREGATOR_TOML.format(extra='metrics_address = "127.0.0.1:9464"'))
    assert AggregatorConfig.load(agg).metrics_address == MetricsAddress("127.0.0.1", 9464)
    agent.write_text(AGENT_TOML.format(extra='metrics_address = "host-a:9465"'))
    with pytest.raises(ConfigError, match=r"agent.toml: metrics_address 'host-a:9465': 'host-a' is not an IP"):
        AgentConfig.load(agent)
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_METRICS_ADDRESS", "127.0.0.1:99999")
    with pytest.raises(ConfigError, match="aggregator.toml: metrics_address '127.0.0.1:99999': the port"):
        AggregatorConfig.load(agg)


def test_command_line_flag_overrides_the_config_and_a_bad_one_stops_the_start(tmp_path, capsys):
    agg, agent = tmp_path / "aggregator.toml", tmp_path / "agent.toml"
    agg.write_text(AGGREGATOR_TOML.format(extra='metrics_address = "127.0.0.1:9464"'))
    agent.write_text(AGENT_TOML.format(extra=""))
    assert AggregatorConfig.load(agg).with_metrics_address("", "--metrics-address").metrics_address is None
    assert aggregator_cli.main(["serve", "--config", str(agg), "--metrics-address", "127.0.0.1"]) == 2
    assert "error: --metrics-address: metrics_address '127.0.0.1' is not HOST:PORT" in capsys.readouterr().err
    assert agent_cli.main(["run", "--config", str(agent), "--metrics-address", "[::1]:x"]) == 2
    assert "error: --metrics-address: metrics_address '[::1]:x': the port must be a number" in capsys.readouterr().err
    assert not (tmp_path / "state").exists() and not (tmp_path / "work").exists()  # nothing started


def test_endpoint_serves_its_registry_and_a_taken_port_is_a_clear_error(tmp_path):
    registry = CollectorRegistry()
    Counter("fedclinic_test_things", "things", registry=registry).inc(3)
    server = MetricsServer(registry, MetricsAddress("127.0.0.1", 0))
    try:
        assert server.address.port > 0 and server.loopback
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(server.url, timeout=10) as resp:
            assert "fedclinic_test_things_total 3.0" in resp.read().decode()
        server.publish(tmp_path / "metrics.addr")
        assert str(server.address) in (tmp_path / "metrics.addr").read_text()
        with pytest.raises(OSError, match="choose another metrics_address"):
            MetricsServer(CollectorRegistry(), server.address)
    finally:
        server.close()
    with pytest.raises(ConnectionRefusedError):  # closed: nothing listens there any more
        socket.create_connection(("127.0.0.1", server.address.port), timeout=5).close()


def test_task_labels_stay_bounded():
    registry = CollectorRegistry()
    rounds = Counter("rounds", "r", ["task_id"], registry=registry)
    sent = Counter("sent", "s", ["task_id", "kind"], registry=registry)
    series = TaskSeries(keep_ended=2)
    for t in ("t1", "t2", "t3"):
        series.labels(rounds, t).inc()
        series.labels(sent, t, "x").inc(5)
    series.labels(rounds, "t4").inc()
    for t in ("t1", "t2", "t3"):
        series.ended(t)
    tasks = {dict(labels)["task_id"] for (_, labels) in samples(registry)}
    assert tasks == {"t2", "t3", "t4"}  # t1 ended longest ago: gone; t4 is running: kept
    assert series.tracked() == {"t2", "t3", "t4"}
    assert samples(registry)[("sent_total", frozenset({("task_id", "t3"), ("kind", "x")}))] == 5


def test_aggregator_counts_lifecycle_events_and_reads_state_from_the_store(tmp_path):
    store = SqliteStore(tmp_path)
    metrics = AggregatorMetrics(keep_ended_tasks=1)
    store.on_commit = metrics.on_commit
    engine = Engine(store, BlobStore(tmp_path / "blobs"), metrics=metrics)
    pkg = ModelPackage({"w": np.zeros(3, np.float32)})
    engine.blobs.put(raw_bytes(pkg.tensors["w"]))

    def submit(key: str) -> str:
        spec = Task(name="m", dataset="d", labels=["a", "b"], min_sites=2, round_timeout_s=600,
                    on_quorum_miss="retry", max_round_retries=1).to_spec()
        return engine.create_task("alice", key, spec, pkg.manifest())

    first = submit("k1")
    engine.site_connected("s1")
    (item,) = engine.next_work("s1", {})
    got = samples(metrics.registry)
    assert got[("fedclinic_aggregator_tasks_submitted_total", frozenset())] == 1
    assert got[("fedclinic_aggregator_rounds_opened_total", frozenset({("task_id", first)}))] == 1
    assert got[("fedclinic_aggregator_connected_agents", frozenset())] == 1
    assert got[("fedclinic_aggregator_open_rounds", frozenset())] == 1
    assert got[("fedclinic_aggregator_outstanding_assignments", frozenset())] == 1
    for _ in range(2):  # the deadline passes twice: reopened once (retry), then the task fails
        store.execute("UPDATE rounds SET deadline_ms=0 WHERE task_id=?", (first,))
        engine.tick()
    got = samples(metrics.registry)
    assert got[("fedclinic_aggregator_round_quorum_misses_total", frozenset({("task_id", first)}))] == 1
    assert ("fedclinic_aggregator_rounds_closed_total", frozenset({("task_id", first)})) not in got
    second = submit("k2")
    engine.cancel(second, "alice", "enough")
    got = samples(metrics.registry)
    assert got[("fedclinic_aggregator_tasks_ended_total", frozenset({("state", "failed")}))] == 1
    assert got[("fedclinic_aggregator_tasks_ended_total", frozenset({("state", "cancelled")}))] == 1
    assert got[("fedclinic_aggregator_tasks", frozenset({("state", "failed")}))] == 1
    assert got[("fedclinic_aggregator_open_rounds", frozenset())] == 0
    # keep_ended_tasks=1: the failed task's series (with its one quorum miss) went when the second one ended
    assert not [k for k in got if ("task_id", first) in k[1]]
    assert got[("fedclinic_aggregator_rounds_opened_total", frozenset({("task_id", second)}))] == 1
    engine.site_disconnected("s1")
    assert samples(metrics.registry)[("fedclinic_aggregator_connected_agents", frozenset())] == 0
    store.close()


def test_agent_gauges_read_the_outbox_and_the_privacy_ledger(tmp_path):
    from fedclinic.proto import agent_pb2

    ledger = PrivacyLedger(tmp_path / "ledger.sqlite")
    ledger.set_budget("notes", 8.0, 1e-5)
    ledger.admit("notes", "t1", 3.0, 1e-5)
    ledger.charge("notes", "t1", 1, 1.25)
    outbox = Outbox(tmp_path / "outbox")
    held = {"t9": object()}
    metrics = AgentMetrics(outbox, ledger, lambda: len(held))
    got = samples(metrics.registry)
    notes = frozenset({("dataset", "notes")})
    assert got[("fedclinic_agent_privacy_epsilon_spent", notes)] == pytest.approx(1.25)
    assert got[("fedclinic_agent_privacy_epsilon_committed", notes)] == pytest.approx(3.0)  # max(planned, spent)
    assert got[("fedclinic_agent_privacy_epsilon_budget", notes)] == 8.0
    assert got[("fedclinic_agent_tasks_awaiting_approval", frozenset())] == 1
    assert got[("fedclinic_agent_outbox_depth", frozenset())] == 0
    outbox.put(agent_pb2.UpdateHeader(task_id="t1", round=1), {})
    metrics.assignment_refused("policy")
    metrics.assignment_refused("something new")  # an unknown reason is counted as "error", not a new label
    got = samples(metrics.registry)
    assert got[("fedclinic_agent_outbox_depth", frozenset())] == 1
    assert got[("fedclinic_agent_policy_refusals_total", frozenset({("reason", "policy")}))] == 1
    assert got[("fedclinic_agent_policy_refusals_total", frozenset({("reason", "error")}))] == 1
