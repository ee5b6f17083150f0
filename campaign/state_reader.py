"""The aggregator's state database read from outside, read-only, whichever database it is (issue 21): the
embedded SQLite file of its state folder, or the PostgreSQL database its ``[state]`` table names.

The campaign's checks (:mod:`campaign.ledger_checks`, :mod:`campaign.store_invariants`) read the store while the
aggregator runs and after it was killed: SQLite is opened with ``mode=ro``; PostgreSQL in a read-only transaction
(``default_transaction_read_only``), with the password from the ``[state]`` table's file or the environment, as the
aggregator reads it. Statements use the ``?`` placeholders of the shared SQL (either database).
"""

from __future__ import annotations

import sqlite3
import tomllib
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.postgres_store import connection_kwargs, pg_sql


@dataclass(frozen=True)
class StateReader:
    """Read-only SQL on one aggregator's state: ``state_dir`` (its SQLite file ``aggregator.sqlite``) unless
    ``database`` names a PostgreSQL database."""

    state_dir: Path
    database: DatabaseSettings = field(default_factory=DatabaseSettings)

    @classmethod
    def of_config(cls, config: Path) -> "StateReader":
        """The state an ``aggregator.toml`` names (its ``state_dir`` and ``[state]`` table)."""
        table = tomllib.loads(config.read_text())
        state_dir = Path(table["state_dir"])
        if not state_dir.is_absolute():
            state_dir = config.parent / state_dir
        return cls(state_dir, DatabaseSettings.from_table(table.get("state"), str(config), config.parent))

    @property
    def is_postgresql(self) -> bool:
        return self.database.is_postgresql

    def rows(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """The rows of one read-only statement (FileNotFoundError when the SQLite file does not exist)."""
        if self.database.is_postgresql:
            import psycopg

            kwargs = {**connection_kwargs(self.database, self.database.password()),  # as the aggregator connects
                      "options": "-c default_transaction_read_only=on", "application_name": "fedclinic-campaign-check"}
            with psycopg.connect(self.database.url, **kwargs) as conn:
                return [tuple(r) for r in conn.execute(pg_sql(sql), args).fetchall()]  # type: ignore[arg-type]
        path = self.state_dir / "aggregator.sqlite"
        if not path.exists():  # not created on open: mode=ro would only say "unable to open database file"
            raise FileNotFoundError(f"the aggregator's state database {path} does not exist")
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
            return list(db.execute(sql, args).fetchall())
