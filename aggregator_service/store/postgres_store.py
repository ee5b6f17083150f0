"""The aggregator's state in PostgreSQL (psycopg 3): the :class:`~aggregator_service.store.Store` chosen by
``[state] database = "postgresql://..."`` (:mod:`.database_settings`).

Same tables, schema versions and statements as the SQLite store (:mod:`.postgres_schema`, :mod:`.sql_store`,
:mod:`.sql_transaction`); what differs is the connection:

- **Pool.** A ``psycopg_pool.ConnectionPool`` of up to ``[state] pool_size`` connections (autocommit; each is
  checked before use, so a restarted server costs one failed check, not a failed call) shared by the gRPC threads.
  A read outside a transaction takes a pooled connection for that one statement.
- **Transactions.** One PostgreSQL transaction per :meth:`PostgresStore.transaction` (READ COMMITTED). Writers are
  serial, as with SQLite's single writer: a process-wide lock, then ``pg_advisory_xact_lock`` (held until commit),
  so two aggregators on one database never interleave either; the event sequence therefore grows in commit order
  (``WatchTask`` resumes from ``seq`` without missing an event). Reads made by the thread inside its transaction go
  to the transaction's connection and see its uncommitted writes, as on SQLite. ``on_commit`` runs after the
  commit, still under the process-wide lock, so events reach it in commit order.
- **Durability.** COMMIT returns once the server has the transaction durable (its ``synchronous_commit``; keep
  it on).
- **Errors.** A bad URL, an unreachable server or refused credentials are a StoreError at start naming
  ``user@host:port/dbname`` (never the password); a newer schema version is refused as on SQLite.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import structlog

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.migrations import StoreError
from aggregator_service.store.postgres_schema import (LOCK_KEY, check_not_newer, migrate_postgres,
                                                      read_pg_schema_version)
from aggregator_service.store.sql_rows import DbRow
from aggregator_service.store.sql_store import SqlStore
from aggregator_service.store.sql_transaction import SqlTransaction

log = structlog.get_logger("fedclinic.aggregator.store")

CONNECT_TIMEOUT_S = 10
#: how long a caller waits for a free pooled connection before its call fails
POOL_WAIT_S = 30.0


@lru_cache(maxsize=512)
def pg_sql(sql: str) -> str:
    """The shared statements' ``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


def db_rows(cursor: Any) -> Any:
    """psycopg row factory: rows indexable by position and column name, like ``sqlite3.Row``."""
    index = {d.name: i for i, d in enumerate(cursor.description or ())}
    return lambda values: DbRow(values, index)


class PgConnection:
    """A psycopg connection that runs the shared ``?`` statements (what :class:`SqlTransaction` calls)."""

    def __init__(self, conn: Any) -> None:
        self.raw = conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self.raw.execute(pg_sql(sql), tuple(args))


class PostgresTransaction(SqlTransaction):
    """The writes of one PostgreSQL transaction (see :meth:`PostgresStore.transaction`)."""


class PostgresStore(SqlStore):
    """The state in the PostgreSQL database of ``settings`` (migrated to this build's schema on open); spill files,
    blobs and the audit trail stay in ``state_dir``."""

    def __init__(self, settings: DatabaseSettings, state_dir: Path, *, prepare: bool = True) -> None:
        """Open the store; with ``prepare`` (the default) also migrate the database to this build's schema and point
        stored spill paths into ``state_dir`` (:meth:`prepare`). A hot-standby replica opens it with
        ``prepare=False``: it only checks that the schema is not newer than this build's (StoreError otherwise) and
        writes nothing until it is elected (aggregator_service.server)."""
        import psycopg
        from psycopg_pool import ConnectionPool, PoolTimeout

        self._state_dir = Path(state_dir)
        self._state_dir.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.where = settings.where()
        self.on_commit = None
        #: HA (aggregator_service.leader_election): called with the connection inside every transaction, after the
        #: write lock; raising rolls the transaction back (a replica that is not the leader commits nothing)
        self.fence: Callable[[Any], None] | None = None
        self._write_lock = threading.Lock()
        self._local = threading.local()
        password = settings.password()
        kwargs = connection_kwargs(settings, password)
        try:  # one direct connection first: its error says why (a pool would only time out)
            with psycopg.connect(settings.url, **kwargs) as conn:
                if prepare:
                    migrate_postgres(conn, self.where, self._state_dir)
                else:
                    check_not_newer(read_pg_schema_version(conn), self.where)
        except psycopg.Error as exc:
            raise cannot_connect(self.where, exc, password) from None
        self._pool = ConnectionPool(settings.url, kwargs=kwargs, min_size=1, max_size=settings.pool_size,
                                    open=False, timeout=POOL_WAIT_S, name="fedclinic-store",
                                    check=ConnectionPool.check_connection)
        try:
            self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S * 3)
        except PoolTimeout:
            self._pool.close()
            raise StoreError(f"cannot open connections to the PostgreSQL database {self.where} ([state] database) "
                             f"within {CONNECT_TIMEOUT_S * 3} s, although a first connection worked: check the "
                             "server's max_connections and load") from None
        log.info("store on PostgreSQL", database=self.where, pool_size=settings.pool_size, prepared=prepare)
        if prepare:
            self._relocate_spill_paths()

    def prepare(self) -> None:
        """Migrate the database to this build's schema (StoreError when it is newer or a step fails) and point stored
        spill paths into this state folder: what opening with ``prepare=True`` does, for a replica just elected."""
        with self._pool.connection() as conn:
            migrate_postgres(conn, self.where, self._state_dir)
        self._relocate_spill_paths()

    @property
    def state_dir(self) -> Path:
        return self._state_dir

    @property
    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            return read_pg_schema_version(conn)

    @contextmanager
    def transaction(self) -> Iterator[PostgresTransaction]:
        """BEGIN; the advisory lock; the writes; COMMIT (ROLLBACK on an exception). Its events go to ``on_commit``
        after the commit. Not reentrant: a transaction inside another one on the same thread is an error."""
        if getattr(self._local, "conn", None) is not None:
            raise StoreError("a store transaction was started inside another one on the same thread")
        with self._write_lock:
            with self._pool.connection() as conn:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
                    if self.fence is not None:
                        self.fence(conn)
                    tx = PostgresTransaction(PgConnection(conn))
                    self._local.conn = conn
                    try:
                        yield tx
                    finally:
                        self._local.conn = None
            if tx.events and self.on_commit is not None:
                self.on_commit(tx.events)

    def close(self) -> None:
        self._pool.close()

    def _rows(self, sql: str, args: tuple = ()) -> list[Any]:
        conn = getattr(self._local, "conn", None)
        if conn is not None:  # inside this thread's transaction: see its writes
            return conn.execute(pg_sql(sql), args).fetchall()
        with self._pool.connection() as conn:
            return conn.execute(pg_sql(sql), args).fetchall()


def connection_kwargs(settings: DatabaseSettings, password: str | None) -> dict[str, Any]:
    """psycopg's connection arguments for ``settings`` (the password from :meth:`DatabaseSettings.password`)."""
    kwargs: dict[str, Any] = {"autocommit": True, "row_factory": db_rows, "connect_timeout": CONNECT_TIMEOUT_S,
                              "application_name": "fedclinic-aggregator"}
    if password is not None:
        kwargs["password"] = password
    return kwargs


def cannot_connect(where: str, exc: Exception, password: str | None) -> StoreError:
    """The error for a failed connection to the database ``where``: libpq's reason (the password redacted) and what
    to check."""
    return StoreError(f"cannot use the PostgreSQL database {where} ([state] database): "
                      f"{_redact(str(exc).strip(), password)}. Check that the server runs and accepts "
                      "connections from this host, the database and user exist, and the password "
                      "([state] database_password_file or FEDCLINIC_DATABASE_PASSWORD)")


def _redact(message: str, password: str | None) -> str:
    return message.replace(password, "***") if password else message
