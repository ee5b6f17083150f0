"""The aggregator's state on PostgreSQL (aggregator_service.store.postgres_store) on the suite's real server: the
same schema versions as SQLite, a newer schema refused and left alone, start-up errors that name the server and
never the password, the `[state]` settings, and writers serialized across threads and across two aggregators on
one database (events in commit order, a thread's reads inside its transaction see its writes)."""

from __future__ import annotations

import threading

import pytest

from aggregator_service.config import AggregatorConfig
from aggregator_service.store import (MIGRATIONS, SCHEMA_VERSION, DatabaseSettings, PostgresStore, StoreError,
                                      open_store)
from aggregator_service.store.postgres_schema import STEPS
from aggregator_service.store.sqlite_store import SqliteStore
from tests.helpers.postgres_server import free_port
from fedclinic.errors import ConfigError
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import control_pb2, task_pb2

S = control_pb2
AGG = 'listen = "127.0.0.1:0"\nstate_dir = "state"\n[tls]\ncert = "a"\nkey = "b"\nca = "c"\n'
TABLES = {"meta", "tasks", "models", "rounds", "assignments", "updates", "site_declines", "events", "model_deltas",
          "site_statements", "secure_sums", "result_phases", "site_results"}


@pytest.fixture()
def database(postgres_server):
    name = postgres_server.create_database()
    yield name
    postgres_server.drop_database(name)


def _settings(server, database: str, **kw) -> DatabaseSettings:
    return DatabaseSettings(url=server.dsn(database), password_file=server.password_file(), pool_size=4, **kw)


def test_every_sqlite_schema_step_has_its_postgresql_twin():
    assert sorted(STEPS) == [m.to for m in MIGRATIONS] and max(STEPS) == SCHEMA_VERSION


def test_an_empty_database_is_migrated_to_the_current_version(postgres_server, database, tmp_path):
    store = PostgresStore(_settings(postgres_server, database), tmp_path)
    try:
        assert store.schema_version == SCHEMA_VERSION
        tables = {r[0] for r in postgres_server.admin_sql(
            "SELECT tablename FROM pg_tables WHERE schemaname='public'", dbname=database)}
        assert tables == TABLES
        assert store.one("SELECT value FROM meta WHERE key='state_dir'").value == str(tmp_path)
    finally:
        store.close()
    again = PostgresStore(_settings(postgres_server, database), tmp_path)  # a second start migrates nothing
    assert again.schema_version == SCHEMA_VERSION
    again.close()


def test_a_newer_schema_is_refused_and_left_alone(postgres_server, database, tmp_path):
    PostgresStore(_settings(postgres_server, database), tmp_path).close()
    postgres_server.admin_sql(f"UPDATE meta SET value='{SCHEMA_VERSION + 1}' WHERE key='schema_version'", database)
    with pytest.raises(StoreError, match=rf"PostgreSQL database postgres@127\.0\.0\.1:{postgres_server.port}/"
                                         rf"{database} has schema version {SCHEMA_VERSION + 1}, newer than this"):
        PostgresStore(_settings(postgres_server, database), tmp_path)
    assert postgres_server.admin_sql("SELECT value FROM meta WHERE key='schema_version'", database) == [
        (str(SCHEMA_VERSION + 1),)]


def test_start_up_errors_name_the_server_and_never_the_password(postgres_server, database, tmp_path, monkeypatch):
    wrong = "not-the-password-4711"
    (tmp_path / "wrong").write_text(wrong + "\n")
    bad = DatabaseSettings(url=postgres_server.dsn(database), password_file=tmp_path / "wrong")
    with pytest.raises(StoreError) as refused:
        PostgresStore(bad, tmp_path)
    text = str(refused.value)
    assert f"127.0.0.1:{postgres_server.port}/{database}" in text and "password authentication failed" in text
    assert wrong not in text and postgres_server.password not in text
    port = free_port()  # nobody listens there
    closed = DatabaseSettings(url=f"postgresql://fedclinic@127.0.0.1:{port}/{database}")
    with pytest.raises(StoreError, match=rf"fedclinic@127\.0\.0\.1:{port}/{database}.*(refused|failed)"):
        PostgresStore(closed, tmp_path)
    monkeypatch.setenv("FEDCLINIC_DATABASE_PASSWORD", postgres_server.password)  # the environment works too
    store = open_store(DatabaseSettings(url=postgres_server.dsn(database)), tmp_path)
    assert isinstance(store, PostgresStore) and store.schema_version == SCHEMA_VERSION
    store.close()


def test_state_settings_are_checked_when_the_configuration_loads(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDCLINIC_DATABASE_PASSWORD", raising=False)
    (tmp_path / "pw").write_text("s3cret\n")

    def load(state: str) -> AggregatorConfig:
        (tmp_path / "agg.toml").write_text(AGG + "[state]\n" + state)
        return AggregatorConfig.load(tmp_path / "agg.toml")

    (tmp_path / "plain.toml").write_text(AGG)
    plain = AggregatorConfig.load(tmp_path / "plain.toml")
    assert not plain.state.is_postgresql and isinstance(open_store(plain.state, tmp_path / "s"), SqliteStore)
    cfg = load('database = "postgresql://agg@db.example:6543/fed"\ndatabase_password_file = "pw"\npool_size = 8\n')
    assert cfg.state.password_file == tmp_path / "pw" and cfg.state.password() == "s3cret"
    assert cfg.state.pool_size == 8 and cfg.state.where() == "agg@db.example:6543/fed"
    for state, message in [
        ('database = "postgresql://agg:s3cret@db/fed"\n', "carries a password; never put it in the configuration"),
        ('database = "postgresql://agg@db/fed?password=s3cret"\n', "carries a password"),
        ('database = "mysql://agg@db/fed"\n', r"must be \"sqlite\" or a postgresql:// URL, got 'mysql://'"),
        ('database = "postgresql://agg@db/fed"\ndatabase_password_file = "missing"\n',
         "cannot read the database password file .*missing"),
        ('database = "postgresql://agg@db/fed"\npassword = "x"\n', r"\[state\] has unknown keys \['password'\]"),
        ('database = "postgresql://agg@db/fed"\npool_size = 1\n', "pool_size must be a whole number from 2"),
        ('database_password_file = "pw"\n', "the state is the embedded SQLite database"),
    ]:
        with pytest.raises(ConfigError, match=message) as refused:
            load(state)
        assert "s3cret" not in str(refused.value)
    monkeypatch.setenv("FEDCLINIC_DATABASE_PASSWORD", "from-env")
    with pytest.raises(ConfigError, match="both .* and FEDCLINIC_DATABASE_PASSWORD are set"):
        load('database = "postgresql://agg@db/fed"\ndatabase_password_file = "pw"\n')
    assert load('database = "postgresql://agg@db/fed"\n').state.password() == "from-env"


def _task(tx, task_id: str) -> None:
    tx.insert_task(task_id, "alice", task_id, task_pb2.TaskSpec(name="n"), S.TASK_STATE_QUEUED, 1, "m0")


def test_writers_are_serial_across_two_aggregators_and_reads_in_a_transaction_see_its_writes(
        postgres_server, database, tmp_path):
    """Two stores on one database (two aggregator processes): while one holds a transaction the other's waits
    (the advisory lock), so event numbers follow commit order; the holder reads its own uncommitted rows, others
    do not see them until the commit."""
    first = PostgresStore(_settings(postgres_server, database), tmp_path / "a")
    second = PostgresStore(_settings(postgres_server, database), tmp_path / "b")
    inside, release, second_done = threading.Event(), threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def hold_open() -> None:
        try:
            with first.transaction() as tx:
                _task(tx, "t-1")
                tx.add_event("t-1", "submitted", "first")
                assert first.task("t-1") is not None  # this thread's read sees its uncommitted write
                inside.set()
                assert release.wait(30)
        except BaseException as exc:  # reported below
            failures.append(exc)
            inside.set()

    def write_second() -> None:
        with second.transaction() as tx:
            _task(tx, "t-2")
            tx.add_event("t-2", "submitted", "second")
        second_done.set()

    holder = threading.Thread(target=hold_open)
    holder.start()
    assert inside.wait(30) and not failures
    other = threading.Thread(target=write_second)
    other.start()
    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type='Lock' AND wait_event='advisory' "
               "AND application_name='fedclinic-aggregator'")
    wait_until(lambda: postgres_server.admin_sql(waiting) == [(1,)], 30, "the second writer to wait on the lock")
    assert not second_done.is_set()
    assert second.task("t-1") is None and first.task("t-1") is None  # uncommitted: invisible to other readers
    release.set()
    holder.join(30)
    other.join(30)
    assert not failures and second_done.is_set()
    seq_1 = first.events_of("t-1")[0].seq
    seq_2 = first.events_of("t-2")[0].seq
    assert seq_1 < seq_2  # numbered in commit order
    with pytest.raises(StoreError, match="inside another one"):
        with first.transaction():
            with first.transaction():
                pass
    first.close()
    second.close()


def test_backup_refuses_a_postgresql_state_with_the_right_advice(tmp_path, capsys, monkeypatch):
    from aggregator_service.cli import main

    monkeypatch.delenv("FEDCLINIC_DATABASE_PASSWORD", raising=False)
    (tmp_path / "agg.toml").write_text(AGG + '[state]\ndatabase = "postgresql://agg@db.example/fed"\n')
    assert main(["backup", "--config", str(tmp_path / "agg.toml"), str(tmp_path / "backup")]) == 2
    err = capsys.readouterr().err
    assert "keeps its state in PostgreSQL" in err and "pg_dump" in err and not (tmp_path / "backup").exists()


def test_a_standby_opens_the_database_without_writing_and_migrates_only_when_told(tmp_path, postgres_server):
    """A hot standby's store (prepare=False) checks the schema and writes nothing, so a newer release's standby never
    migrates the database under an older leader; prepare() (on election) migrates it. A newer schema is refused."""
    name = postgres_server.create_database()
    try:
        settings = DatabaseSettings(url=postgres_server.dsn(name), password_file=postgres_server.password_file(),
                                    pool_size=2)
        standby = PostgresStore(settings, tmp_path / "state", prepare=False)
        assert postgres_server.admin_sql("SELECT to_regclass('meta') IS NULL", name) == [(True,)]
        assert standby.schema_version == 0
        standby.prepare()
        assert standby.schema_version == SCHEMA_VERSION
        standby.prepare()  # again: nothing to do
        standby.close()
        postgres_server.admin_sql(f"UPDATE meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'", name)
        with pytest.raises(StoreError, match=f"has schema version {SCHEMA_VERSION + 1}, newer than this"):
            PostgresStore(settings, tmp_path / "state", prepare=False)
    finally:
        postgres_server.drop_database(name)
