"""Fixtures for integration tests: real processes, real certificates, loopback only, tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedclinic.federation.local_federation import LocalFederation, SiteSetup

from tests.helpers.postgres_server import postgres_state
from tests.helpers.text_models import write_site_data

pytestmark = pytest.mark.integration

#: which store the federations' aggregators keep their state in: "sqlite" (the default, `make test`) or
#: "postgresql" (`make test-postgresql`: every federation on a database of this worker's PostgreSQL server)
STORE = os.environ.get("FEDCLINIC_TEST_STORE", "sqlite")


@pytest.fixture(scope="session", autouse=True)
def aggregator_store(request):
    """The one switch of the integration suite's store: with ``FEDCLINIC_TEST_STORE=postgresql`` every
    LocalFederation (and MaliciousAggregator) that names no ``[state]`` gets a fresh database of this worker's
    PostgreSQL server, the same one each time its aggregator restarts on the same state folder. Yields the backend's
    name."""
    if STORE not in ("sqlite", "postgresql"):
        raise pytest.UsageError(f"FEDCLINIC_TEST_STORE must be sqlite or postgresql, not {STORE!r}")
    if STORE == "sqlite":
        yield STORE
        return
    server = request.getfixturevalue("postgres_server")
    databases: dict[Path, str] = {}

    def state_for(state_dir: Path) -> dict:
        key = Path(state_dir).resolve()
        if key not in databases:
            databases[key] = server.create_database()
        return postgres_state(server, databases[key])

    LocalFederation.default_state = state_for
    try:
        yield STORE
    finally:
        LocalFederation.default_state = None


@pytest.fixture(autouse=True)
def _sqlite_state_only(request, aggregator_store):
    """Tests marked ``sqlite_state`` exercise the embedded SQLite file itself (its backup and restore): skipped on
    PostgreSQL, whose state is backed up with pg_dump."""
    if aggregator_store != "sqlite" and request.node.get_closest_marker("sqlite_state"):
        pytest.skip("exercises the embedded SQLite state file (backup/restore); the state is in PostgreSQL")


@pytest.fixture
def federation_factory(tmp_path, request):
    """Build LocalFederations with N sites holding synthetic clinical-ish text; torn down after the test."""
    made: list[LocalFederation] = []

    def make(n_sites: int = 3, *, samples=(24, 32, 40), start: bool = True, **kwargs) -> LocalFederation:
        sites = []
        for i in range(n_sites):
            name = f"site-{chr(ord('a') + i)}"
            path = write_site_data(tmp_path / "data" / name, samples[i % len(samples)], seed=i)
            sites.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl"}}))
        fed = LocalFederation(tmp_path / "fed", sites, agent_threads=1, **kwargs)
        made.append(fed)
        if start:
            fed.start()
        return fed

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for fed in made:
        fed.close()
        if failed:
            for log in sorted(fed.logs.glob("*.log")):
                print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-4000:]}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
