"""The aggregator's durable state: the :class:`Store` interface (:mod:`.interface`), its typed records
(:mod:`.records`), the statements both databases run (:mod:`.sql_store` reads, :mod:`.sql_transaction` writes), the
SQLite implementation (:mod:`.sqlite_store`, the embedded default) and its schema steps (:mod:`.migrations`), the
PostgreSQL one (:mod:`.postgres_store`, :mod:`.postgres_schema`), and which one a configuration names
(:mod:`.database_settings`, :func:`open_store`)."""

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.interface import Store, StoreTransaction
from aggregator_service.store.migrations import MIGRATIONS, SCHEMA_VERSION, Migration, StoreError, read_schema_version
from aggregator_service.store.records import (AssignmentRecord, EventRecord, ResultPhaseRecord, RoundRecord,
                                              SiteResultRecord, StateGauges, TaskRecord, UpdateRecord, now_ms)
from aggregator_service.store.open_store import open_store
from aggregator_service.store.postgres_store import PostgresStore
from aggregator_service.store.sql_rows import manifest_from_json, manifest_to_json
from aggregator_service.store.sqlite_store import SqliteStore

__all__ = ["AssignmentRecord", "DatabaseSettings", "EventRecord", "MIGRATIONS", "Migration", "PostgresStore", "ResultPhaseRecord", "RoundRecord",
           "SiteResultRecord", "SCHEMA_VERSION", "SqliteStore",
           "StateGauges", "Store", "StoreError", "StoreTransaction", "TaskRecord", "UpdateRecord", "manifest_from_json",
           "manifest_to_json", "now_ms", "open_store", "read_schema_version"]
