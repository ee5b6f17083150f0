"""The aggregator's durable state: the :class:`Store` interface (:mod:`.interface`), its typed records
(:mod:`.records`), the SQLite implementation (:mod:`.sqlite_store`) and its schema steps (:mod:`.migrations`)."""

from aggregator_service.store.interface import Store, StoreTransaction
from aggregator_service.store.migrations import MIGRATIONS, SCHEMA_VERSION, Migration, StoreError, read_schema_version
from aggregator_service.store.records import (AssignmentRecord, EventRecord, ResultPhaseRecord, RoundRecord,
                                              SiteResultRecord, StateGauges, TaskRecord, UpdateRecord, now_ms)
from aggregator_service.store.sqlite_store import SqliteStore, manifest_from_json, manifest_to_json

__all__ = ["AssignmentRecord", "EventRecord", "MIGRATIONS", "Migration", "ResultPhaseRecord", "RoundRecord",
           "SiteResultRecord", "SCHEMA_VERSION", "SqliteStore",
           "StateGauges", "Store", "StoreError", "StoreTransaction", "TaskRecord", "UpdateRecord", "manifest_from_json",
           "manifest_to_json", "now_ms", "read_schema_version"]
