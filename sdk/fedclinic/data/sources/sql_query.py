"""A dataset read with the site admin's own SELECT: the rows of one read-only query, mapped by column name.

Settings (``[datasets.NAME]`` of agent.toml, beside those of :mod:`.database`)::

    source = "sql"
    query = "SELECT note_text AS text, diagnosis AS label, person_id FROM study.training_notes ORDER BY note_id"
    eval_query = "SELECT ..."     # optional: the held-out split
    text_field = "text"           # the result columns holding the text, the label(s) and the patient id
    label_field = "label"         # (a multi-label row: "a|b", or an array column)
    group_field = "person_id"     # optional: per-patient differential privacy

Both queries pass :func:`fedclinic.data.sources.sql_guard.check_select` when the configuration is loaded and
run in a read-only transaction (:meth:`Database.read_only`). Give the query an ORDER BY: rows are used in the
order the database returns them, and a stable order makes a task's run repeatable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from fedclinic.data.sources.database import Database, Runner, check_database
from fedclinic.data.sources.records import DataSource, Record, SourceCheck
from fedclinic.data.sources.sql_guard import check_select
from fedclinic.errors import ConfigError, DatasetError

SQL_KEYS = ("query", "eval_query")
MISSING_COLUMN = "the query result lacks a column the site configuration names"


class SqlSource(DataSource):
    kind = "sql"

    def __init__(self, name: str, db: Database, query: str, *, eval_query: str | None = None,
                 text_field: str = "text", label_field: str = "label", group_field: str | None = None) -> None:
        super().__init__(name)
        self.db, self.query, self.eval_query = db, query, eval_query
        self.text_field, self.label_field, self.group_field = text_field, label_field, group_field
        self.has_patient_ids = group_field is not None

    @classmethod
    def from_entry(cls, name: str, entry: dict[str, Any], base: Path, where: str) -> "SqlSource":
        db = Database.from_entry(entry, base, where)
        if "query" not in entry:
            raise ConfigError(f"{where}: a SQL source needs query = \"SELECT ...\" (one read-only SELECT "
                              "whose columns hold the text, the label and optionally the patient id)")
        query = check_select(entry["query"], f"{where} query")
        eval_query = check_select(entry["eval_query"], f"{where} eval_query") if "eval_query" in entry else None
        return cls(name, db, query, eval_query=eval_query, text_field=entry.get("text_field", "text"),
                   label_field=entry.get("label_field", "label"), group_field=entry.get("group_field"))

    @property
    def where(self) -> str:
        return f"dataset {self.name!r} ({self.db.describe()})"

    @property
    def has_eval(self) -> bool:
        return self.eval_query is not None

    def _fields(self) -> list[str]:
        return [self.text_field, self.label_field] + ([self.group_field] if self.group_field else [])

    def records(self, split: str = "train",
                on_bad_row: Callable[[DatasetError], None] | None = None) -> list[Record]:
        self._split(split)
        query = self.query if split == "train" else self.eval_query
        with self.db.read_only() as run:
            columns, rows = run(query)
        index = self._columns(columns, split)
        out = []
        for i, row in enumerate(rows, start=1):
            out.append(Record(i, row[index[0]], row[index[1]], row[index[2]] if len(index) > 2 else None,
                              where=f"{self.where}: row {i}"))
        return out

    def _columns(self, columns: list[str], split: str) -> list[int]:
        missing = [f for f in self._fields() if f not in columns]
        if missing:
            which = "query" if split == "train" else "eval_query"
            raise DatasetError(f"{self.where}: the {which}'s result has no column(s) {missing}; found columns "
                               f"{columns}. Name them in the SELECT (e.g. note_text AS {self.text_field}) or set "
                               "text_field / label_field / group_field", rule=MISSING_COLUMN)
        return [columns.index(f) for f in self._fields()]

    def check(self) -> SourceCheck:
        def queries(run: Runner, report: SourceCheck) -> None:
            for split, query in (("train", self.query), ("eval", self.eval_query)):
                if query is not None:
                    _check_query(self, run, split, query, report)

        return check_database(self.db, queries)


def _check_query(source: SqlSource, run: Runner, split: str, query: str, report: SourceCheck) -> None:
    which = "query" if split == "train" else "eval_query"
    columns, _ = run(f"SELECT * FROM ({query}) AS fedclinic_q LIMIT 0")
    try:
        source._columns(columns, split)
    except DatasetError as exc:
        report.problems.append(str(exc))
        return
    report.facts.append(f"{which}: columns {', '.join(source._fields())} present")
    _, rows = run(f"SELECT count(*) FROM ({query}) AS fedclinic_q")
    count = int(rows[0][0])
    if count == 0:
        report.problems.append(f"{source.where}: the {which} returns no rows; check its WHERE clause and that the "
                               "database user may see the rows")
    else:
        report.facts.append(f"{which}: {count} row(s)")


__all__ = ["MISSING_COLUMN", "SQL_KEYS", "SqlSource"]
