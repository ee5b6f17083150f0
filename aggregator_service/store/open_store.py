"""The store a configuration names: :func:`open_store`."""

from __future__ import annotations

from pathlib import Path

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.interface import Store


def open_store(settings: DatabaseSettings, state_dir: Path, *, prepare: bool = True) -> Store:
    """The PostgreSQL store when ``[state] database`` is a postgresql:// URL, else the SQLite store of
    ``state_dir``; either migrated to this build's schema (StoreError when it cannot be). ``prepare=False``
    (PostgreSQL only: a hot standby) defers the migration to :meth:`PostgresStore.prepare`."""
    if settings.is_postgresql:
        from aggregator_service.store.postgres_store import PostgresStore

        return PostgresStore(settings, state_dir, prepare=prepare)
    from aggregator_service.store.sqlite_store import SqliteStore

    return SqliteStore(state_dir)
