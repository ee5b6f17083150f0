"""Site dataset readers with schema validation.

A text-classification dataset is a JSONL, CSV or TSV file with one example per row:

* JSONL: one JSON object per line, ``{"text": "...", "label": "..."}``; for a multi-label task the label may
  be a list (``"labels": [...]`` is accepted too). Blank lines are skipped.
* CSV / TSV: a header row naming the columns; multi-label labels are separated by ``|``.

Every problem raises :class:`~fedclinic.errors.DatasetError` naming the file, the row (1-based; in CSV/TSV
the header is row 1) and what to do about it. Nothing is read lazily: a file that passes is fully valid.

:func:`read_dataset` dispatches on the task's family to the readers of :mod:`.ner`, :mod:`.qa` and :mod:`.image`;
what the readers share is in :mod:`.files`.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

# FORMATS, MULTI_LABEL_SEPARATOR, infer_format, require_text and jsonl_objects are also re-exported here, where
# they were defined before fedclinic.data.files
from fedclinic.data.files import (  # noqa: F401
    FORMATS,
    MULTI_LABEL_SEPARATOR,
    check_label_set,
    decode_guard,
    fmt_labels,
    infer_format,
    jsonl_objects,
    jsonl_rows,
    open_text,
    parse_labels,
    require_text,
)
from fedclinic.data.image import read_image_text
from fedclinic.data.ner import read_ner
from fedclinic.data.qa import read_qa
from fedclinic.data.sources.records import DataSource
from fedclinic.errors import ConfigError, DatasetError


@dataclass(frozen=True)
class Example:
    """One labelled text. ``labels`` holds one label for single-label tasks, any number >= 1 otherwise."""

    text: str
    labels: tuple[str, ...]


def read_classification(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    text_field: str = "text",
    label_field: str = "label",
    label_set: Sequence[str],
    multi_label: bool = False,
    on_bad_row: Callable[[DatasetError], None] | None = None,
) -> list[Example]:
    """Read and validate a text-classification dataset; returns its examples in file order.

    With ``on_bad_row`` the reading is tolerant: each row that breaks the contract (unparsable, missing or empty
    text, missing or unknown label, several labels in a single-label task) is handed to it as its DatasetError
    and skipped, and a file without a valid row gives ``[]``; errors of the whole file (missing, not UTF-8, no
    header) still raise. Federated statistics count the bad rows this way
    (``fedclinic.evaluation.statistics``)."""
    labels = check_label_set(label_set)
    fmt = (format or "").lower() or infer_format(path)
    if fmt not in FORMATS:
        raise DatasetError(f"{path}: unknown dataset format {format!r}; use one of {', '.join(FORMATS)}",
                           rule="the dataset format is not one of jsonl, csv, tsv")
    rows = _jsonl_rows(path, text_field, label_field, on_bad_row) if fmt == "jsonl" else _table_rows(
        path, text_field, label_field, delimiter="," if fmt == "csv" else "\t", on_bad_row=on_bad_row)
    out = _examples(path, ((f"{path}: row {n}", n, t, lab) for n, t, lab in rows), text_field=text_field,
                    label_field=label_field, fmt=fmt, labels=labels, multi_label=multi_label, on_bad_row=on_bad_row)
    if not out and on_bad_row is None:
        raise DatasetError(f"{path}: the dataset is empty (no example rows); point the site at a file with data",
                           rule="the dataset is empty")
    return out


def read_source_classification(
    source: DataSource,
    *,
    split: str = "train",
    label_set: Sequence[str],
    multi_label: bool = False,
    on_bad_row: Callable[[DatasetError], None] | None = None,
) -> list[Example]:
    """The text-classification examples of a registered data source (:mod:`fedclinic.data.sources`: SQL, OMOP,
    FHIR NDJSON, Parquet), validated row by row exactly as :func:`read_classification` validates a file's rows
    (same rules, same DatasetError, same ``on_bad_row`` tolerance): the same rows give the same examples
    wherever they are stored. ``split``: "train" or "eval" (the source's held-out split)."""
    labels = check_label_set(label_set)
    records = source.records(split, on_bad_row)
    out = _examples(source.where, ((r.where, r.row, r.text, r.labels) for r in records), text_field="text",
                    label_field="label", fmt=source.kind, labels=labels, multi_label=multi_label,
                    on_bad_row=on_bad_row)
    if not out and on_bad_row is None:
        raise DatasetError(f"{source.where}: the dataset is empty (the source gives no example rows); check its "
                           "query, mapping or export with `hospital-agent check-config`", rule="the dataset is empty")
    return out


def _examples(path, rows: Iterable[tuple[str, int, Any, Any]], *, text_field: str, label_field: str, fmt: str,
              labels: list[str], multi_label: bool,
              on_bad_row: Callable[[DatasetError], None] | None) -> list[Example]:
    """The Example of every ``(where, row number, text, raw labels)`` row; a bad row raises (or goes to
    ``on_bad_row`` and is skipped)."""
    allowed = set(labels)
    order = {lab: i for i, lab in enumerate(labels)}
    out: list[Example] = []
    for where, row_no, text, raw_labels in rows:
        try:
            out.append(_example(where, row_no, text, raw_labels, text_field=text_field, label_field=label_field,
                                fmt=fmt, labels=labels, allowed=allowed, order=order, multi_label=multi_label))
        except DatasetError as exc:
            if on_bad_row is None:
                raise
            on_bad_row(exc)
    return out


def _example(where: str, row_no: int, text: Any, raw_labels: Any, *, text_field: str, label_field: str, fmt: str,
             labels: list[str], allowed: set[str], order: dict[str, int], multi_label: bool) -> Example:
    """One row's Example, or the DatasetError that names what is wrong with it (``where``: "PATH: row N")."""
    require_text(text, where, text_field, "the text to classify")
    found = parse_labels(raw_labels, where, label_field, fmt, allowed)
    if not found:
        raise DatasetError(f"{where}: missing label (field {label_field!r}); every row needs a label from "
                           f"{fmt_labels(labels)}", rule="the label is missing", row=row_no)
    unknown = [lab for lab in found if lab not in allowed]
    if unknown:
        raise DatasetError(f"{where}: unknown label {unknown[0]!r}; allowed labels are {fmt_labels(labels)} "
                           "(fix the row or add the label to the task's label set)",
                           rule="a label is not in the task's label set", row=row_no)
    found = sorted(set(found), key=order.__getitem__)
    if not multi_label and len(found) > 1:
        raise DatasetError(f"{where}: {len(found)} labels {found} in a single-label task; give one label per "
                           "row or declare the task multi_label",
                           rule="more than one label in a single-label task", row=row_no)
    return Example(text=text, labels=tuple(found))


def read_dataset(
    family: str,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    text_field: str = "text",
    label_field: str = "label",
    entities_field: str = "entities",
    question_field: str = "question",
    answer_field: str = "answer",
    context_field: str = "context",
    image_field: str = "image",
    label_set: Sequence[str] | None = None,
    multi_label: bool = False,
    on_bad_row: Callable[[DatasetError], None] | None = None,
) -> list:
    """Read a site dataset for a task of ``family``: :func:`read_classification` rows, NER examples
    (:func:`fedclinic.data.ner.read_ner`, JSONL spans or CoNLL) for ``token-classification``, question/answer
    pairs (:func:`fedclinic.data.qa.read_qa`, JSONL) for ``question-answering``, where ``label_set`` is ignored
    (a generation task has no labels), or image + report examples (:func:`fedclinic.data.image.read_image_text`,
    a CSV/TSV/JSONL manifest of image paths, reports and labels; always multi-label) for
    ``image-text-classification``. The ``*_field`` arguments name the columns of each family. ``on_bad_row``
    makes the text-classification reader tolerant (:func:`read_classification`); the other readers ignore it and
    raise on the first bad row."""
    if family == "question-answering":
        return read_qa(path, format=format, question_field=question_field, answer_field=answer_field,
                       context_field=context_field)
    if label_set is None:
        raise ConfigError(f"a {family} dataset needs the task's label_set")
    if family == "token-classification":
        return read_ner(path, format=format, label_set=label_set, text_field=text_field,
                        entities_field=entities_field)
    if family == "image-text-classification":
        return read_image_text(path, format=format, label_set=label_set, image_field=image_field,
                               text_field=text_field, label_field=label_field)
    return read_classification(path, format=format, text_field=text_field, label_field=label_field,
                               label_set=label_set, multi_label=multi_label, on_bad_row=on_bad_row)


def _jsonl_rows(path, text_field: str, label_field: str,
                on_bad_row: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[int, Any, Any]]:
    with open_text(path) as fh:
        lines = decode_guard(path, fh.read).splitlines()
    for row_no, obj in jsonl_rows(path, lines, f"{text_field!r} and {label_field!r}", on_bad_row):
        raw = obj.get(label_field)
        if raw is None and label_field != "labels":
            raw = obj.get("labels")
        yield row_no, obj.get(text_field), raw


def _table_rows(path, text_field: str, label_field: str, delimiter: str,
                on_bad_row: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[int, Any, Any]]:
    with open_text(path) as fh:
        content = decode_guard(path, fh.read)
    reader = csv.reader(content.splitlines(keepends=True), delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        raise DatasetError(f"{path}: the dataset is empty (no header row); the first row must name the columns, "
                           f"e.g. {text_field}{delimiter}{label_field}",
                           rule="the dataset is empty (no header row)") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}: row 1: malformed header ({exc})", rule="the header row is malformed",
                           row=1) from None
    header = [h.strip() for h in header]
    missing = [f for f in (text_field, label_field) if f not in header]
    if missing:
        raise DatasetError(f"{path}: row 1: the header has no column(s) {missing}; found columns {header}. "
                           "Rename the columns or set text_field/label_field",
                           rule="the header row lacks a column the site configuration names", row=1)
    ti, li = header.index(text_field), header.index(label_field)
    row_no = 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            error = DatasetError(f"{path}: row {row_no + 1}: malformed {('CSV', 'TSV')[delimiter == chr(9)]} "
                                 f"({exc})", rule="the row is malformed", row=row_no + 1)
            if on_bad_row is None:
                raise error from None
            on_bad_row(error)
            row_no += 1
            continue
        row_no += 1
        if not row or all(not c.strip() for c in row):
            continue
        yield row_no, row[ti] if ti < len(row) else None, row[li] if li < len(row) else None
