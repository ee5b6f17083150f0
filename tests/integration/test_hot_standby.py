"""Two aggregator replicas on one PostgreSQL database and one state folder (issue 21 item 3): the standby reports
NOT_SERVING and refuses calls with UNAVAILABLE; SIGKILLing the leader mid-round hands over to the standby, which
recovers the open round; agents given both addresses fail over, and the task completes with exact counts."""

from __future__ import annotations

import signal

import pytest

from fedclinic.client import state_name
from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import aggregator_store
from tests.helpers.ha import NOT_SERVING, SERVING, health, start_replica
from tests.helpers.postgres_server import free_port, postgres_state
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

#: the done-when bound: the standby serves within this many seconds of the leader's SIGKILL
TAKEOVER_S = 15


def test_the_standby_takes_over_a_sigkilled_leader_mid_round_with_exact_counts(federation_factory, postgres_server,
                                                                                 postgres_database):
    port_a, port_b = free_port(), free_port()
    a, b = f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"
    fed = federation_factory(2, start=False, aggregator_settings={
        "listen": a, "state": postgres_state(postgres_server, postgres_database),
        "ha": {"enabled": True, "poll_s": 0.2}})
    fed.make_pki()
    assert fed.start_aggregator() == a  # the first replica wins the lock and publishes its address
    standby = start_replica(fed, "b", port_b)
    wait_until(lambda: health(fed, b) == NOT_SERVING, 60, "the standby to listen, NOT_SERVING",
               check=lambda: standby.poll() is None or pytest.fail(fed.log_text("aggregator-b")))
    assert health(fed, a) == SERVING
    with fed.client(b) as client, pytest.raises(FedclinicError, match="standby"):
        client.list()  # the standby refuses the control API (UNAVAILABLE, saying it is the standby)

    fed.start_agent("site-a", f"{a},{b}")
    with fed.client(a) as client:
        st = client.submit(make_task(num_rounds=2, min_sites=2, round_timeout_s=300), package=tiny_package("logreg"))
        wait_until(lambda: [len(r.reports) for r in client.status(st.task_id).rounds][:1] == [1], 120,
                   "site-a's durable round-1 update")
    assert fed.signal_aggregator(signal.SIGKILL) == -signal.SIGKILL
    wait_until(lambda: health(fed, b) == SERVING, TAKEOVER_S, "the standby to serve after the leader's SIGKILL")
    fed.start_agent("site-b", f"{a},{b}")  # the dead leader first: it fails over to the new one
    with fed.client(b) as client:
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    # exact: each site once per round, site-a's round-1 update (acknowledged by the dead leader) not lost nor
    # counted twice, and site-a's agent followed the new leader for round 2
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b"]] * 2
    log_b = fed.log_text("aggregator-b")
    assert "elected leader" in log_b and "round recovered" in log_b
    assert "trying the next address" in fed.log_text("agent-site-a")
    with aggregator_store(fed) as store:
        assert store.task(st.task_id).final_model == final.final_model_hash
        assert store.update_count(st.task_id, 1) == 2 and store.update_count(st.task_id, 2) == 2


def test_ha_needs_postgresql(tmp_path):
    from aggregator_service.leader_election import HaSettings
    from aggregator_service.store import DatabaseSettings
    from fedclinic.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the state in PostgreSQL"):
        HaSettings.from_table({"enabled": True}, "aggregator.toml", DatabaseSettings())
    with pytest.raises(ConfigError, match="poll_s"):
        HaSettings.from_table({"poll_s": 0}, "aggregator.toml", DatabaseSettings())
