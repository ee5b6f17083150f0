"""The Prometheus endpoints of the aggregator and the agents, scraped over HTTP during and after a real task."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.prometheus import scrape, scrape_agent, value
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def test_metrics_are_scraped_during_a_task_and_match_its_round_summaries(federation_factory):
    agg = "fedclinic_aggregator_"
    fed = federation_factory(2, start=False, metrics_address="127.0.0.1:0")
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")  # site-b comes later: round 1 waits for it, so the task is surely running below
    with fed.client() as client:
        st = client.submit(make_task(name="it-metrics", num_rounds=2, min_sites=2, strategy="dp-fedavg",
                                 strategy_params={"clip_norm": 0.05, "noise_multiplier": 0.5},
                                 privacy={"level": "client"}), package=tiny_package())
        task = st.task_id

        # during the task: round 1 is open with site-a's update in it
        wait_until(lambda: value(scrape(fed.metrics_url()), agg + "updates_received_total", task_id=task) == 1, 120,
                   "the aggregator to count site-a's update")
        during = scrape(fed.metrics_url())
        assert state_name(client.status(task).state) == "running"
        assert value(during, agg + "rounds_opened_total", task_id=task) == 1
        assert value(during, agg + "rounds_closed_total", task_id=task) == 0
        assert value(during, agg + "uplink_payload_bytes_total", task_id=task) > 0
        assert value(during, agg + "downlink_bytes_total", task_id=task) > 0
        assert value(during, agg + "connected_agents") == 1
        assert value(during, agg + "tasks", state="running") == 1
        assert value(during, agg + "open_rounds") == 1
        assert value(during, agg + "pending_updates") == 1
        wait_until(lambda: value(scrape_agent(fed, "site-a"), "fedclinic_agent_updates_acknowledged_total",
                                 task_id=task) == 1, 60, "site-a to count its acknowledged update")
        agent_during = scrape_agent(fed, "site-a")
        assert value(agent_during, "fedclinic_agent_rounds_trained_total", task_id=task) == 1
        assert value(agent_during, "fedclinic_agent_update_payload_bytes_sent_total", task_id=task) > 0
        assert value(agent_during, "fedclinic_agent_aggregator_connected") == 1
        assert value(agent_during, "fedclinic_agent_outbox_depth") == 0

        fed.start_agent("site-b")
        final = client.wait(task, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error

    after = scrape(fed.metrics_url())
    rounds = final.rounds
    reports = [rep for r in rounds for rep in r.reports]
    assert len(rounds) == 2 and len(reports) == 4
    assert value(after, agg + "rounds_opened_total", task_id=task) == len(rounds)
    assert value(after, agg + "rounds_closed_total", task_id=task) == len(rounds)
    assert value(after, agg + "round_duration_seconds_count") == len(rounds)
    assert value(after, agg + "updates_received_total", task_id=task) == len(reports)
    assert value(after, agg + "update_processing_seconds_count", outcome="accepted") == len(reports)
    assert value(after, agg + "uplink_payload_bytes_total", task_id=task) == sum(r.uplink_bytes for r in rounds)
    assert value(after, agg + "uplink_wire_bytes_total", task_id=task) == sum(rep.uplink_wire_bytes for rep in reports)
    assert value(after, agg + "downlink_bytes_total", task_id=task) == sum(r.downlink_bytes for r in rounds)
    for site in ("site-a", "site-b"):
        assert value(after, agg + "site_updates_received_total", site=site) == 2
    assert value(after, agg + "tasks_submitted_total") == 1
    assert value(after, agg + "tasks_ended_total", state="completed") == 1
    assert value(after, agg + "tasks", state="completed") == 1
    assert value(after, agg + "open_rounds") == 0 and value(after, agg + "pending_updates") == 0
    assert value(after, agg + "privacy_epsilon", task_id=task, level="client") == pytest.approx(
        rounds[-1].metrics["client_dp_epsilon"])
    assert value(after, agg + "updates_refused_total", reason="invalid_argument") == 0

    received = 0.0
    for site in ("site-a", "site-b"):
        mine = [rep for rep in reports if rep.site_id == site]
        agent = scrape_agent(fed, site)
        assert value(agent, "fedclinic_agent_rounds_trained_total", task_id=task) == len(mine)
        assert value(agent, "fedclinic_agent_updates_acknowledged_total", task_id=task) == len(mine)
        assert value(agent, "fedclinic_agent_update_payload_bytes_sent_total", task_id=task) == sum(
            rep.uplink_bytes for rep in mine)
        assert value(agent, "fedclinic_agent_update_wire_bytes_sent_total", task_id=task) == sum(
            rep.uplink_wire_bytes for rep in mine)
        assert value(agent, "fedclinic_agent_training_seconds_count") == len(mine)
        received += value(agent, "fedclinic_agent_model_bytes_received_total", task_id=task)
    assert received == sum(r.downlink_bytes for r in rounds)  # what the agents fetched is what was served


def test_refused_calls_are_counted_by_kind(federation_factory):
    from fedclinic.proto import agent_pb2, agent_pb2_grpc
    from fedclinic.transport.rpc import TlsFiles, secure_channel

    fed = federation_factory(1, metrics_address="127.0.0.1:0")
    c = fed.creds("scientist")  # a scientist's certificate may not call the agent service
    with secure_channel(fed.address, TlsFiles(Path(c["cert"]), Path(c["key"]), Path(c["ca"])), server_name="localhost") as channel:
        with pytest.raises(grpc.RpcError) as err:
            agent_pb2_grpc.AgentServiceStub(channel).Hello(agent_pb2.HelloRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    samples = scrape(fed.metrics_url())
    assert value(samples, "fedclinic_aggregator_auth_refusals_total", reason="role") == 1
    assert value(samples, "fedclinic_aggregator_auth_refusals_total", reason="revoked") == 0
