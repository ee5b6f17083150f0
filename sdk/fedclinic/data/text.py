"""Site dataset readers with schema validation.

A text-classification dataset is a JSONL, CSV or TSV file with one example per row:

* JSONL: one JSON object per line, ``{"text": "...", "label": "..."}``; for a multi-label task the label may
  be a list (``"labels": [...]`` is accepted too). Blank lines are skipped.
* CSV / TSV: a header row naming the columns; multi-label labels are separated by ``|``.

Every problem raises :class:`~fedclinic.errors.DatasetError` naming the file, the row (1-based; in CSV/TSV
the header is row 1) and what to do about it. Nothing is read lazily: a file that passes is fully valid.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from fedclinic.errors import ConfigError, DatasetError

FORMATS = ("jsonl", "csv", "tsv")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}
MULTI_LABEL_SEPARATOR = "|"


@dataclass(frozen=True)
class Example:
    """One labelled text. ``labels`` holds one label for single-label tasks, any number >= 1 otherwise."""

    text: str
    labels: tuple[str, ...]


def infer_format(path: str | os.PathLike[str]) -> str:
    """'jsonl' / 'csv' / 'tsv' from the file suffix (.jsonl/.ndjson, .csv, .tsv)."""
    suffix = Path(path).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise DatasetError(f"{path}: cannot tell the format from the suffix {suffix!r}; rename the file to "
                           f".jsonl/.csv/.tsv or pass format= one of {', '.join(FORMATS)}") from None


def read_classification(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    text_field: str = "text",
    label_field: str = "label",
    label_set: Sequence[str],
    multi_label: bool = False,
) -> list[Example]:
    """Read and validate a text-classification dataset; returns its examples in file order."""
    labels = _check_label_set(label_set)
    fmt = (format or "").lower() or infer_format(path)
    if fmt not in FORMATS:
        raise DatasetError(f"{path}: unknown dataset format {format!r}; use one of {', '.join(FORMATS)}")
    rows = _jsonl_rows(path, text_field, label_field) if fmt == "jsonl" else _table_rows(
        path, text_field, label_field, delimiter="," if fmt == "csv" else "\t")
    allowed = set(labels)
    order = {lab: i for i, lab in enumerate(labels)}
    out: list[Example] = []
    for row_no, text, raw_labels in rows:
        where = f"{path}: row {row_no}"
        require_text(text, where, text_field, "the text to classify")
        found = _parse_labels(raw_labels, where, label_field, fmt, allowed)
        if not found:
            raise DatasetError(f"{where}: missing label (field {label_field!r}); every row needs a label from "
                               f"{_fmt_labels(labels)}")
        unknown = [lab for lab in found if lab not in allowed]
        if unknown:
            raise DatasetError(f"{where}: unknown label {unknown[0]!r}; allowed labels are {_fmt_labels(labels)} "
                               "(fix the row or add the label to the task's label set)")
        found = sorted(set(found), key=order.__getitem__)
        if not multi_label and len(found) > 1:
            raise DatasetError(f"{where}: {len(found)} labels {found} in a single-label task; give one label per "
                               "row or declare the task multi_label")
        out.append(Example(text=text, labels=tuple(found)))
    if not out:
        raise DatasetError(f"{path}: the dataset is empty (no example rows); point the site at a file with data")
    return out


def require_text(text: object, where: str, field: str, purpose: str) -> str:
    """``text`` if it is a non-empty string, else a DatasetError naming ``where``, the field and what to do
    (``purpose``: what every row needs, e.g. "the text to classify")."""
    if text is None:
        raise DatasetError(f"{where}: missing text field {field!r}; every row needs {purpose}")
    if not isinstance(text, str):
        raise DatasetError(f"{where}: text field {field!r} must be a string, got {type(text).__name__}")
    if not text.strip():
        raise DatasetError(f"{where}: empty text in field {field!r}; remove the row or fill in the text")
    return text


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
) -> list:
    """Read a site dataset for a task of ``family``: :func:`read_classification` rows, NER examples
    (:func:`fedclinic.data.ner.read_ner`, JSONL spans or CoNLL) for ``token-classification``, question/answer
    pairs (:func:`fedclinic.data.qa.read_qa`, JSONL) for ``question-answering``, where ``label_set`` is ignored
    (a generation task has no labels), or image + report examples (:func:`fedclinic.data.image.read_image_text`,
    a CSV/TSV/JSONL manifest of image paths, reports and labels; always multi-label) for
    ``image-text-classification``. The ``*_field`` arguments name the columns of each family."""
    if family == "question-answering":
        from fedclinic.data.qa import read_qa

        return read_qa(path, format=format, question_field=question_field, answer_field=answer_field,
                       context_field=context_field)
    if label_set is None:
        raise ConfigError(f"a {family} dataset needs the task's label_set")
    if family == "token-classification":
        from fedclinic.data.ner import read_ner

        return read_ner(path, format=format, label_set=label_set, text_field=text_field,
                        entities_field=entities_field)
    if family == "image-text-classification":
        from fedclinic.data.image import read_image_text

        return read_image_text(path, format=format, label_set=label_set, image_field=image_field,
                               text_field=text_field, label_field=label_field)
    return read_classification(path, format=format, text_field=text_field, label_field=label_field,
                               label_set=label_set, multi_label=multi_label)


def jsonl_objects(path, lines: Sequence[str], expects: str) -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for every non-blank line of a JSONL file (``where`` = "PATH: row N", 1-based), the
    one JSONL row parser of the dataset readers. DatasetError naming the row for invalid JSON or a value that is
    not an object (``expects`` says what the object should hold)."""
    for row_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}: row {row_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                               "JSON object") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object with {expects}, got {type(obj).__name__}")
        yield where, obj


def _check_label_set(label_set: Sequence[str]) -> list[str]:
    if isinstance(label_set, str) or not label_set:
        raise ConfigError(f"label_set must be a non-empty list of label names, got {label_set!r}")
    labels = list(label_set)
    if len(set(labels)) != len(labels) or not all(isinstance(x, str) and x for x in labels):
        raise ConfigError(f"label_set must hold unique non-empty strings, got {labels!r}")
    return labels


def _fmt_labels(labels: Sequence[str], limit: int = 30) -> str:
    shown = ", ".join(repr(x) for x in labels[:limit])
    return f"[{shown}{', ...' if len(labels) > limit else ''}]"


def _parse_labels(raw: Any, where: str, label_field: str, fmt: str, allowed: set[str]) -> list[str]:
    """Normalise a raw label value to a list of label strings (empty = missing)."""
    if raw is None:
        return []
    if isinstance(raw, bool) or isinstance(raw, float):
        raise DatasetError(f"{where}: label {raw!r} in field {label_field!r} must be a label name (string)")
    if isinstance(raw, int):
        return [str(raw)]
    if isinstance(raw, str):
        value = raw.strip()
        if not value:
            return []
        if fmt != "jsonl" and value not in allowed and MULTI_LABEL_SEPARATOR in value:
            return [p.strip() for p in value.split(MULTI_LABEL_SEPARATOR) if p.strip()]
        return [value]
    if isinstance(raw, list):
        out = []
        for item in raw:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise DatasetError(f"{where}: label list in field {label_field!r} holds {item!r}; labels must be "
                                   "strings")
            if str(item).strip():
                out.append(str(item).strip())
        return out
    raise DatasetError(f"{where}: label field {label_field!r} must be a string or a list of strings, "
                       f"got {type(raw).__name__}")


def _open_text(path: str | os.PathLike[str]):
    try:
        return open(path, encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found; check the dataset path in the site configuration") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a dataset file") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable file ({exc.strerror or exc}); check the path and its "
                           "permissions") from None


def _decode_guard(path, fn):
    try:
        return fn()
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: unreadable file: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                           "save it as UTF-8") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable file ({exc}); check the path and its permissions") from None


def _jsonl_rows(path, text_field: str, label_field: str) -> Iterator[tuple[int, Any, Any]]:
    with _open_text(path) as fh:
        lines = _decode_guard(path, fh.read).splitlines()
    for row_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: row {row_no}: invalid JSON ({exc.msg} at column {exc.colno}); each line "
                               "must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DatasetError(f"{path}: row {row_no}: expected a JSON object with {text_field!r} and "
                               f"{label_field!r}, got {type(obj).__name__}")
        raw = obj.get(label_field)
        if raw is None and label_field != "labels":
            raw = obj.get("labels")
        yield row_no, obj.get(text_field), raw


def _table_rows(path, text_field: str, label_field: str, delimiter: str) -> Iterator[tuple[int, Any, Any]]:
    with _open_text(path) as fh:
        content = _decode_guard(path, fh.read)
    reader = csv.reader(content.splitlines(keepends=True), delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        raise DatasetError(f"{path}: the dataset is empty (no header row); the first row must name the columns, "
                           f"e.g. {text_field}{delimiter}{label_field}") from None
    except csv.Error as exc:
        raise DatasetError(f"{path}: row 1: malformed header ({exc})") from None
    header = [h.strip() for h in header]
    missing = [f for f in (text_field, label_field) if f not in header]
    if missing:
        raise DatasetError(f"{path}: row 1: the header has no column(s) {missing}; found columns {header}. "
                           "Rename the columns or set text_field/label_field")
    ti, li = header.index(text_field), header.index(label_field)
    row_no = 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DatasetError(f"{path}: row {row_no + 1}: malformed {('CSV', 'TSV')[delimiter == chr(9)]} "
                               f"({exc})") from None
        row_no += 1
        if not row or all(not c.strip() for c in row):
            continue
        yield row_no, row[ti] if ti < len(row) else None, row[li] if li < len(row) else None
