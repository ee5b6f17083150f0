"""``check-config``'s look at a PostgreSQL state database: can this host reach it, and which schema does it hold.

It opens one connection with the aggregator's own settings (URL, password file or environment, connect timeout)
and only reads: the server's version and ``meta.schema_version`` (0 for an empty database). It never creates,
migrates or locks anything; ``serve`` does that when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.postgres_schema import read_pg_schema_version
from aggregator_service.store.postgres_store import cannot_connect, connection_kwargs


@dataclass(frozen=True)
class DatabaseProbe:
    """What :func:`probe_postgres` found: ``where`` (user@host:port/dbname), the server's version string and the
    database's schema version (0: no fedclinic schema yet)."""

    where: str
    server_version: str
    schema_version: int


def probe_postgres(settings: DatabaseSettings) -> DatabaseProbe:
    """Connect once to the PostgreSQL database of ``settings`` and read what :class:`DatabaseProbe` holds; StoreError
    saying what to check when the connection or the reads fail (the same message ``serve`` gives)."""
    import psycopg

    password = settings.password()
    where = settings.where()
    try:
        with psycopg.connect(settings.url, **connection_kwargs(settings, password)) as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
            return DatabaseProbe(where=where, server_version=str(server), schema_version=read_pg_schema_version(conn))
    except psycopg.Error as exc:
        raise cannot_connect(where, exc, password) from None
