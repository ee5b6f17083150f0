"""An OMOP CDM data source: clinical notes as texts, the patient's conditions around the note as labels.

Settings (``[datasets.NAME]`` of agent.toml, beside those of :mod:`.database`)::

    source = "omop"
    schema = "cdm"                  # optional: the schema of the CDM tables (PostgreSQL)
    window_days = 30                # a condition labels a note when it started within 30 days of the note date
    note_type_concept_ids = [44814637]   # optional: only notes of these types
    unmapped_label = "other"        # optional (label_map): the label of notes with no mapped condition
    eval_share = 0.2                # optional (label_map): the held-out split, by patient

    [datasets.NAME.labels]          # condition_concept_id -> label name
    "201826" = "diabetes"

What is read (fedclinic writes these two queries; neither the admin nor a task passes SQL here)::

    SELECT note_id, person_id, note_date, note_text FROM [schema.]note
        [WHERE note_type_concept_id IN (...)] ORDER BY note_id
    SELECT person_id, condition_concept_id, condition_start_date FROM [schema.]condition_occurrence
        WHERE condition_concept_id IN (the mapped concept ids)

    labels(note) = { labels[c.condition_concept_id] : c.person_id = note.person_id,
                                                       |c.condition_start_date - note.note_date| <= window_days }

A note without a mapped condition is left out (or labelled ``unmapped_label``). ``person_id`` is each row's
patient id (per-patient differential privacy needs no group_field). Both queries run in one read-only
transaction (:meth:`Database.read_only`).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

from fedclinic.data.sources.database import Database, Runner, check_database
from fedclinic.data.sources.label_map import eval_share, optional_label, parse_label_map, split_of
from fedclinic.data.sources.records import DataSource, Record, SourceCheck
from fedclinic.data.sources.sql_guard import identifier
from fedclinic.errors import ConfigError, DatasetError

OMOP_KEYS = ("schema", "window_days", "note_type_concept_ids", "labels", "unmapped_label", "eval_share")
NOTE_COLUMNS = ("note_id", "person_id", "note_date", "note_text")
CONDITION_COLUMNS = ("person_id", "condition_concept_id", "condition_start_date")
BAD_DATE = "a note or condition date is not a date"


class OmopSource(DataSource):
    kind = "omop"
    has_patient_ids = True

    def __init__(self, name: str, db: Database, labels: dict[int, str], *, schema: str | None = None,
                 window_days: int = 30, note_types: tuple[int, ...] = (), unmapped_label: str | None = None,
                 eval_share: float = 0.0) -> None:
        super().__init__(name)
        self.db, self.labels, self.schema = db, labels, schema
        self.window, self.note_types = dt.timedelta(days=window_days), note_types
        self.unmapped_label, self.eval_share = unmapped_label, eval_share

    @classmethod
    def from_entry(cls, name: str, entry: dict[str, Any], base: Path, where: str) -> "OmopSource":
        db = Database.from_entry(entry, base, where)
        labels = parse_label_map(entry.get("labels"), where, lambda k: k.isdigit(), '"201826"')
        window = entry.get("window_days", 30)
        if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= 36500:
            raise ConfigError(f"{where} window_days must be a whole number of days 0-36500, got {window!r}")
        types = entry.get("note_type_concept_ids", [])
        if not isinstance(types, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
            raise ConfigError(f"{where} note_type_concept_ids must be a list of concept ids, e.g. [44814637]")
        schema = identifier(entry["schema"], f"{where} schema") if "schema" in entry else None
        return cls(name, db, {int(k): v for k, v in labels.items()}, schema=schema, window_days=window,
                   note_types=tuple(types), unmapped_label=optional_label(entry.get("unmapped_label"), where),
                   eval_share=eval_share(entry.get("eval_share"), where))

    @property
    def where(self) -> str:
        return f"dataset {self.name!r} (OMOP CDM, {self.db.describe()})"

    @property
    def has_eval(self) -> bool:
        return self.eval_share > 0

    def _table(self, name: str) -> str:
        return f"{self.schema}.{name}" if self.schema else name

    def _note_sql(self) -> str:
        types = f" WHERE note_type_concept_id IN ({', '.join(str(int(t)) for t in self.note_types)})" \
            if self.note_types else ""
        return f"SELECT note_id, person_id, note_date, note_text FROM {self._table('note')}{types} ORDER BY note_id"

    def _condition_sql(self) -> str:
        ids = ", ".join(str(int(c)) for c in sorted(self.labels))
        return (f"SELECT person_id, condition_concept_id, condition_start_date FROM "
                f"{self._table('condition_occurrence')} WHERE condition_concept_id IN ({ids})")

    def _read(self, run: Runner) -> list[tuple[Any, Any, Any, list[str]]]:
        """(note_id, person_id, note_text, label names) of every note, in note_id order."""
        _, conditions = run(self._condition_sql())
        by_person: dict[Any, list[tuple[dt.date, str]]] = defaultdict(list)
        for person, concept, start in conditions:
            by_person[person].append((_date(start, f"{self.where}: condition of a person"), self.labels[int(concept)]))
        _, notes = run(self._note_sql())
        out = []
        for i, (note_id, person, day, text) in enumerate(notes, start=1):
            when = _date(day, f"{self.where}: note_id {note_id}", row=i)
            found = sorted({lab for start, lab in by_person.get(person, ()) if abs(start - when) <= self.window})
            out.append((note_id, person, text, found))
        return out

    def records(self, split: str = "train",
                on_bad_row: Callable[[DatasetError], None] | None = None) -> list[Record]:
        self._split(split)
        with self.db.read_only() as run:
            notes = self._read(run)
        out = []
        for i, (note_id, person, text, found) in enumerate(notes, start=1):
            if split_of(person, self.eval_share) != split:
                continue
            if not found and self.unmapped_label is None:
                continue  # a note without a mapped condition: not part of the dataset (check-config counts them)
            out.append(Record(i, text, found or [self.unmapped_label], person,
                              where=f"{self.where} note_id {note_id}: row {i}"))
        return out

    def check(self) -> SourceCheck:
        def tables(run: Runner, report: SourceCheck) -> None:
            if self._columns_present(run, report):
                self._counts(self._read(run), report)

        return check_database(self.db, tables)

    def _columns_present(self, run: Runner, report: SourceCheck) -> bool:
        ok = True
        for table, needed in (("note", NOTE_COLUMNS + (("note_type_concept_id",) if self.note_types else ())),
                              ("condition_occurrence", CONDITION_COLUMNS)):
            columns, _ = run(f"SELECT * FROM {self._table(table)} WHERE 1 = 0")
            missing = [c for c in needed if c not in columns]
            if missing:
                ok = False
                report.problems.append(f"{self.where}: table {self._table(table)} has no column(s) {missing}; is it an "
                                       "OMOP CDM (v5.3/5.4) table? set schema = to the CDM's schema")
            else:
                report.facts.append(f"table {self._table(table)}: columns {', '.join(needed)} present")
        return ok

    def _counts(self, notes: list[tuple[Any, Any, Any, list[str]]], report: SourceCheck) -> None:
        labelled = [n for n in notes if n[3]]
        per_label = Counter(lab for n in labelled for lab in n[3])
        several = sum(len(n[3]) > 1 for n in labelled)
        report.facts.append(f"{len(notes)} note(s), {len(labelled)} with a mapped condition within "
                            f"{self.window.days} day(s); per label: "
                            + (", ".join(f"{lab} {k}" for lab, k in sorted(per_label.items())) or "none"))
        if several:
            report.notes.append(f"{several} note(s) have several mapped conditions: only multi-label tasks can use "
                                "them (a single-label task stops at the first)")
        unmapped = len(notes) - len(labelled)
        if unmapped:
            report.notes.append(f"{unmapped} note(s) have no mapped condition in the window and are "
                                + (f"labelled {self.unmapped_label!r}" if self.unmapped_label else
                                   "left out (set unmapped_label to keep them)"))
        if not notes:
            report.problems.append(f"{self.where}: the note table returns no rows; check schema, "
                                   "note_type_concept_ids and that the database user may read it")
        elif not labelled and self.unmapped_label is None:
            report.problems.append(f"{self.where}: no note has a mapped condition within {self.window.days} day(s); "
                                   "check the [labels] concept ids and window_days")
        if self.eval_share:
            held = sum(split_of(n[1], self.eval_share) == "eval" for n in labelled)
            report.facts.append(f"held-out split (eval_share {self.eval_share:g}, by patient): {held} labelled note(s)")


def _date(value: Any, where: str, row: int | None = None) -> dt.date:
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    try:
        return dt.date.fromisoformat(str(value)[:10])
    except ValueError:
        raise DatasetError(f"{where}: {value!r} is not a date (YYYY-MM-DD)", rule=BAD_DATE, row=row) from None


__all__ = ["CONDITION_COLUMNS", "NOTE_COLUMNS", "OMOP_KEYS", "OmopSource"]
