"""Fixtures shared by the unit and integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog


@pytest.fixture(scope="module")
def torch_one_thread():
    """Run a module's tiny models on one torch thread: on the shared 2-core test machine a second thread only
    adds contention (tiny-model training went from ~1 s to ~20 s on a loaded box). Use it with
    ``pytestmark = pytest.mark.usefixtures("torch_one_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for this pytest process (each xdist worker starts its own), started on first use
    and stopped when the session ends (tests/helpers/postgres_server.py)."""
    from tests.helpers.postgres_server import start_server

    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres_database(postgres_server):
    """A fresh, empty database on :func:`postgres_server` for one test module; dropped afterwards. Yields its name
    (``postgres_server.dsn(name)`` is its URL, ``postgres_server.password_file()`` its password)."""
    name = postgres_server.create_database()
    try:
        yield name
    finally:
        postgres_server.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def open_test_store(request, tmp_path):
    """The store backends, one per parameter: a function ``state_dir -> Store`` (migrated, open). Every call of one
    test opens the same database again (a reopen keeps the state): ``state_dir / "aggregator.sqlite"`` for SQLite,
    one fresh database on :func:`postgres_server` for PostgreSQL (dropped after the test)."""
    from aggregator_service.store import DatabaseSettings, PostgresStore, SqliteStore

    opened = []
    database = None

    def open_store(state_dir=tmp_path):
        nonlocal database
        if request.param == "sqlite":
            store = SqliteStore(state_dir)
        else:
            server = request.getfixturevalue("postgres_server")
            database = database or server.create_database()
            settings = DatabaseSettings(url=server.dsn(database), password_file=server.password_file(), pool_size=4)
            store = PostgresStore(settings, state_dir)
        opened.append(store)
        return store

    open_store.backend = request.param
    yield open_store
    for store in opened:
        store.close()
    if database is not None:
        request.getfixturevalue("postgres_server").drop_database(database)


@pytest.fixture(autouse=True)
def _structlog_as_found():
    """Put back the structlog configuration a test found. A test that runs a service's command in-process
    (``aggregator_service.cli.main([...])``) configures structlog for the whole process (a level, JSON, loggers
    cached on first use), and every later test in that worker would then miss the events ``capture_logs`` waits for."""
    before = structlog.get_config()
    yield
    if structlog.get_config() != before:
        structlog.configure(**before)


#: which store the federations' aggregators keep their state in: "sqlite" (the default, `make test`) or
#: "postgresql" (`make test-postgresql`: every federation on a database of this worker's PostgreSQL server)
STORE = os.environ.get("FEDCLINIC_TEST_STORE", "sqlite")


@pytest.fixture(scope="session", autouse=True)
def aggregator_store(request):
    """The one switch of the integration and campaign suites' store: with ``FEDCLINIC_TEST_STORE=postgresql`` every
    LocalFederation (and MaliciousAggregator) that names no ``[state]`` gets a fresh database of this worker's
    PostgreSQL server, the same one each time its aggregator restarts on the same state folder. Yields the backend's
    name."""
    from fedclinic.federation.local_federation import LocalFederation
    from tests.helpers.postgres_server import postgres_state

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
