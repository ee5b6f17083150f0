"""A Parquet file as a dataset: ``[datasets.NAME] path = "notes.parquet"`` (``format = "parquet"``, or the
``.parquet`` suffix), read with pyarrow.

Columns are mapped as in a CSV file: ``text_field``, ``label_field`` (a label name, ``"a|b"``, or a list column
for multi-label rows) and optionally ``group_field`` (the patient id). ``eval_path`` is another Parquet file,
the held-out split. Rows are used in file order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fedclinic.data.sources.records import DataSource, Record, SourceCheck
from fedclinic.errors import DatasetError, FedclinicError

MISSING_COLUMN = "the Parquet file lacks a column the site configuration names"


class ParquetSource(DataSource):
    kind = "parquet"

    def __init__(self, name: str, path: Path, *, eval_path: Path | None = None, text_field: str = "text",
                 label_field: str = "label", group_field: str | None = None) -> None:
        super().__init__(name)
        self.path, self.eval_path = path, eval_path
        self.text_field, self.label_field, self.group_field = text_field, label_field, group_field
        self.has_patient_ids = group_field is not None

    @property
    def where(self) -> str:
        return f"dataset {self.name!r} (Parquet {self.path})"

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None

    def _fields(self) -> list[str]:
        return [self.text_field, self.label_field] + ([self.group_field] if self.group_field else [])

    def _table(self, path: Path):
        import pyarrow.parquet as pq

        if not path.is_file():
            raise DatasetError(f"{path}: file not found; check the dataset path in the site configuration",
                               rule="the dataset file is missing")
        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # pyarrow.ArrowInvalid and OSError: not a Parquet file, unreadable
            raise DatasetError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})",
                               rule="the dataset file cannot be read") from None
        missing = [f for f in self._fields() if f not in schema.names]
        if missing:
            raise DatasetError(f"{path}: no column(s) {missing}; found columns {schema.names}. Rename the columns or "
                               "set text_field / label_field / group_field", rule=MISSING_COLUMN)
        return pq.read_table(path, columns=self._fields())

    def records(self, split: str = "train",
                on_bad_row: Callable[[DatasetError], None] | None = None) -> list[Record]:
        self._split(split)
        path = self.path if split == "train" else self.eval_path
        table = self._table(path)
        cols = [table.column(f).to_pylist() for f in self._fields()]
        ids = cols[2] if len(cols) > 2 else [None] * table.num_rows
        return [Record(i + 1, t, lab, pid, where=f"{path}: row {i + 1}")
                for i, (t, lab, pid) in enumerate(zip(cols[0], cols[1], ids))]

    def check(self) -> SourceCheck:
        report = SourceCheck()
        for which, path in (("path", self.path), ("eval_path", self.eval_path)):
            if path is None:
                continue
            try:
                table = self._table(path)
            except FedclinicError as exc:
                report.problems.append(str(exc))
                continue
            report.facts.append(f"{which}: {path}: columns {', '.join(self._fields())} present, {table.num_rows} row(s)")
            if table.num_rows == 0:
                report.problems.append(f"{path}: the file has no rows")
        return report


__all__ = ["ParquetSource"]
