"""Rows of the aggregator's tables to typed records, shared by the SQLite and PostgreSQL stores: a row is anything
indexable by column name (``sqlite3.Row``, :class:`DbRow`); JSON columns are parsed, the task spec is decoded."""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from fedclinic.transport.package import FileEntry, Manifest, TensorEntry
from fedclinic.proto import task_pb2

from aggregator_service.store.records import (AssignmentRecord, ResultPhaseRecord, RoundRecord, SiteResultRecord,
                                              TaskRecord, UpdateRecord)


def manifest_to_json(m: Manifest) -> str:
    return json.dumps({"tensors": [[t.name, t.dtype, list(t.shape), t.sha256, t.nbytes] for t in m.tensors],
                       "files": [[f.path, f.sha256, f.nbytes] for f in m.files]}, separators=(",", ":"))


def manifest_from_json(text: str) -> Manifest:
    doc = json.loads(text)
    return Manifest(tuple(TensorEntry(n, d, tuple(s), h, b) for n, d, s, h, b in doc["tensors"]),
                    tuple(FileEntry(p, h, b) for p, h, b in doc["files"]))


class DbRow(tuple):
    """A result row indexable by position and by column name, like ``sqlite3.Row`` (the PostgreSQL store's rows)."""

    _index: Mapping[str, int]

    def __new__(cls, values: Sequence[Any], index: Mapping[str, int]) -> "DbRow":
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


class Row:
    """A raw result row as attributes (for the stores' ``one`` / ``all``)."""

    __slots__ = ("_r",)

    def __init__(self, r: Any) -> None:
        self._r = r

    def __getattr__(self, name: str) -> Any:
        try:
            return self._r[name]
        except (IndexError, KeyError):
            raise AttributeError(name) from None


def task_record(r: Any) -> TaskRecord:
    return TaskRecord(r["task_id"], r["owner"], r["idempotency_key"], task_pb2.TaskSpec.FromString(bytes(r["spec"])),
                      r["state"], r["current_round"], r["error"], r["created_ms"], r["updated_ms"],
                      r["initial_model"], r["final_model"])


def round_record(r: Any) -> RoundRecord:
    return RoundRecord(r["task_id"], r["round"], r["attempt"], r["state"], r["sites_target"], r["opened_ms"],
                       r["deadline_ms"], r["closed_ms"], r["base_model"], r["model_hash"], r["uplink_bytes"],
                       r["downlink_bytes"], json.loads(r["metrics"]), json.loads(r["strategy_state"] or "{}"))


def assignment_record(r: Any) -> AssignmentRecord:
    return AssignmentRecord(r["task_id"], r["round"], r["site"], r["attempt"], r["assigned_ms"], r["declined"],
                            r["held"], r["downlink_bytes"], r["downlink_wire_bytes"])


def update_record(r: Any) -> UpdateRecord:
    return UpdateRecord(r["update_id"], r["task_id"], r["round"], r["site"], r["idempotency_key"], r["num_samples"],
                        r["nbytes"], r["spill_path"], r["layout"], json.loads(r["metrics"]),
                        json.loads(r["eval_metrics"]), r["received_ms"], r["fp32_bytes"], r["wire_bytes"],
                        r["spill_sha256"])


def phase_record(r: Any) -> ResultPhaseRecord:
    return ResultPhaseRecord(r["task_id"], r["round"], r["work"], r["model_hash"], r["opened_ms"], r["deadline_ms"],
                             r["closed_ms"])


def result_record(r: Any) -> SiteResultRecord:
    return SiteResultRecord(r["task_id"], r["round"], r["site"], r["model"], r["work"], r["model_hash"],
                            json.loads(r["vals"]), r["min_cell"], r["received_ms"])
