"""The patient id of every row of a site dataset (``group_field``), for per-patient differential privacy.

A site declares which column holds the patient id (``[datasets.X] group_field = "patient_id"`` in agent.toml);
:func:`read_patient_ids` reads that column in the same row order as the dataset readers of :mod:`.text`
(JSONL: every non-blank line; CSV/TSV: every non-blank row after the header), so the ids line up with the
examples one to one (the caller checks the counts). An id is a non-empty string or an integer; ``"17"`` and
``17`` are the same patient. Patient ids are data: they stay in the site's memory and are never logged or sent;
a problem raises :class:`~fedclinic.errors.DatasetError` whose public part names only the rule and the row.
"""

from __future__ import annotations

import csv
import os

from fedclinic.data.files import FORMATS, decode_guard, infer_format, jsonl_rows, open_text
from fedclinic.errors import DatasetError

#: formats that have a column per row for a patient id (CoNLL's token lines have none)
GROUPED_FORMATS = ("jsonl", "csv", "tsv")
MISSING_RULE = "a row has no patient id (the column the site's group_field names)"


def read_patient_ids(path: str | os.PathLike[str], *, group_field: str, format: str | None = None) -> list[str]:
    """The patient id of each example row of the dataset at ``path``, in file order."""
    fmt = (format or "").lower() or infer_format(path)
    if fmt not in GROUPED_FORMATS:
        raise DatasetError(f"{path}: per-patient privacy needs a patient id column, which format {fmt!r} does not "
                           f"have; use one of {', '.join(GROUPED_FORMATS)} (of {', '.join(FORMATS)})",
                           rule="the dataset format has no patient id column")
    with open_text(path) as fh:
        content = decode_guard(path, fh.read)
    if fmt == "jsonl":
        return [_id(obj.get(group_field), path, row_no, group_field)
                for row_no, obj in jsonl_rows(path, content.splitlines(), f"a {group_field!r} patient id")]
    return _table_ids(path, content, group_field, "," if fmt == "csv" else "\t")


def patient_ids_for(path: str | os.PathLike[str], *, group_field: str, format: str | None, rows: int) -> list[str]:
    """:func:`read_patient_ids`, checked to line up with the ``rows`` examples the dataset reader returned."""
    ids = read_patient_ids(path, group_field=group_field, format=format)
    if len(ids) != rows:
        raise DatasetError(f"{path}: {len(ids)} patient ids for {rows} examples; every example row needs its patient's "
                           "id in the group_field column", rule="the patient ids do not line up with the examples")
    return ids


def _table_ids(path, content: str, group_field: str, delimiter: str) -> list[str]:
    reader = csv.reader(content.splitlines(keepends=True), delimiter=delimiter)
    try:
        header = [h.strip() for h in next(reader)]
    except (StopIteration, csv.Error):
        raise DatasetError(f"{path}: no readable header row", rule="the header row is malformed", row=1) from None
    if group_field not in header:
        raise DatasetError(f"{path}: row 1: the header has no patient id column {group_field!r}; found columns "
                           f"{header}. Rename the column or set group_field", rule=MISSING_RULE, row=1)
    col = header.index(group_field)
    out: list[str] = []
    row_no = 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return out
        except csv.Error:
            raise DatasetError(f"{path}: row {row_no + 1}: malformed row", rule="the row is malformed",
                               row=row_no + 1) from None
        row_no += 1
        if not row or all(not c.strip() for c in row):
            continue
        out.append(_id(row[col] if col < len(row) else None, path, row_no, group_field))


def _id(value: object, path, row_no: int, group_field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
        raise DatasetError(f"{path}: row {row_no}: no patient id in {group_field!r} (a non-empty string or an "
                           "integer); every row of a dataset with a group_field needs its patient's id",
                           rule=MISSING_RULE, row=row_no)
    return str(value).strip()


__all__ = ["GROUPED_FORMATS", "patient_ids_for", "read_patient_ids"]
