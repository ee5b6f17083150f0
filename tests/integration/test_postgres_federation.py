"""The aggregator on PostgreSQL end to end (`make test`'s smoke of `make test-postgresql`): a real federation task
whose aggregator is SIGKILLed mid-round and restarted completes with exact counts, its state in the database and no
SQLite file; an unreachable database stops the aggregator at start with an error naming the server, not the
password."""

from __future__ import annotations

import signal

import pytest

from aggregator_service.store import SCHEMA_VERSION
from fedclinic.client import state_name
from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import aggregator_store, keep_aggregator_address
from tests.helpers.postgres_server import free_port, postgres_state
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def test_a_task_on_postgresql_survives_an_aggregator_sigkill_with_exact_counts(federation_factory, postgres_server,
                                                                               postgres_database):
    fed = federation_factory(2, start=False, aggregator_settings={
        "state": postgres_state(postgres_server, postgres_database)})
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)
    fed.start_agent("site-a")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=300), package=tiny_package("logreg"))
        wait_until(lambda: [len(r.reports) for r in client.status(st.task_id).rounds][:1] == [1], 120,
                   "site-a's durable round-1 update")
    assert fed.signal_aggregator(signal.SIGKILL) == -signal.SIGKILL
    fed.start_aggregator()
    fed.start_agent("site-b")
    with fed.client() as client:
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b"]]
    assert "round recovered" in fed.log_text("aggregator")
    assert not (fed.root / "aggregator-state" / "aggregator.sqlite").exists()
    with aggregator_store(fed) as store:  # the rows are in PostgreSQL, one update per site and round
        assert store.task(st.task_id).final_model == final.final_model_hash
        assert store.update_count(st.task_id, 1) == 2 and store.schema_version == SCHEMA_VERSION
    rows = postgres_server.admin_sql(f"SELECT count(*) FROM updates WHERE task_id='{st.task_id}'", postgres_database)
    assert rows == [(2,)]


def test_an_unreachable_database_stops_the_aggregator_naming_the_server(federation_factory, postgres_server):
    port = free_port()
    fed = federation_factory(1, start=False, aggregator_settings={"state": {
        "database": f"postgresql://fedclinic@127.0.0.1:{port}/fedclinic",
        "database_password_file": str(postgres_server.password_file())}})
    fed.make_pki()
    with pytest.raises(FedclinicError, match="the aggregator exited with code 2"):
        fed.start_aggregator(timeout=60)
    log = fed.log_text("aggregator")
    assert f"cannot use the PostgreSQL database fedclinic@127.0.0.1:{port}/fedclinic" in log, log
    assert postgres_server.password not in log
