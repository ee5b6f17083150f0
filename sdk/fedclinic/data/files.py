"""Reading dataset files, shared by every family's reader: formats, opening and decoding with errors that say
what to do, JSONL rows, label parsing and checks.

Every problem raises :class:`~fedclinic.errors.DatasetError` naming the file and the row (1-based). The readers
(:mod:`.text`, :mod:`.ner`, :mod:`.qa`, :mod:`.image`) build on these and never on each other. Each error also
carries ``rule`` and ``row`` (no value from the data): what the hospital agent may tell the aggregator.
"""

from __future__ import annotations

import json
import re
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from fedclinic.errors import ConfigError, DatasetError

FORMATS = ("jsonl", "csv", "tsv")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv"}
MULTI_LABEL_SEPARATOR = "|"

_ROW_AT_END = re.compile(r": (?:row|line) (\d+)$")


def infer_format(path: str | os.PathLike[str]) -> str:
    """'jsonl' / 'csv' / 'tsv' from the file suffix (.jsonl/.ndjson, .csv, .tsv)."""
    suffix = Path(path).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise DatasetError(f"{path}: cannot tell the format from the suffix {suffix!r}; rename the file to "
                           f".jsonl/.csv/.tsv or pass format= one of {', '.join(FORMATS)}",
                           rule="the dataset file's format cannot be told from its name") from None


def row_in(where: str) -> int | None:
    """The row (or line) number a place string such as "PATH: row 3" ends with, for :attr:`DatasetError.row`;
    None when it names none."""
    m = _ROW_AT_END.search(where)
    return int(m.group(1)) if m else None


def require_text(text: object, where: str, field: str, purpose: str) -> str:
    """``text`` if it is a non-empty string, else a DatasetError naming ``where``, the field and what to do
    (``purpose``: what every row needs, e.g. "the text to classify")."""
    if text is None:
        raise DatasetError(f"{where}: missing text field {field!r}; every row needs {purpose}",
                           rule="the text field is missing", row=row_in(where))
    if not isinstance(text, str):
        raise DatasetError(f"{where}: text field {field!r} must be a string, got {type(text).__name__}",
                           rule="the text field is not a string", row=row_in(where))
    if not text.strip():
        raise DatasetError(f"{where}: empty text in field {field!r}; remove the row or fill in the text",
                           rule="the text is empty", row=row_in(where))
    return text


def jsonl_rows(path, lines: Sequence[str], expects: str,
               on_bad_row: Callable[[DatasetError], None] | None = None) -> Iterator[tuple[int, dict]]:
    """``(row number, object)`` for every non-blank line of a JSONL file (rows 1-based), the one JSONL row parser
    of the dataset readers. DatasetError naming the row for invalid JSON or a value that is not an object
    (``expects`` says what the object should hold); with ``on_bad_row`` that error is handed to it instead and the
    row is skipped (the tolerant reading of :func:`fedclinic.data.text.read_classification`)."""
    for row_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: row {row_no}: invalid JSON ({exc.msg} at column {exc.colno}); each "
                                   "line must be one JSON object", rule="the row is not valid JSON",
                                   row=row_no) from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}: row {row_no}: expected a JSON object with {expects}, got "
                                   f"{type(obj).__name__}", rule="the row is not a JSON object", row=row_no)
        except DatasetError as exc:
            if on_bad_row is None:
                raise
            on_bad_row(exc)
            continue
        yield row_no, obj


def jsonl_objects(path, lines: Sequence[str], expects: str) -> Iterator[tuple[str, dict]]:
    """:func:`jsonl_rows` with each row's place as ``where`` ("PATH: row N")."""
    for row_no, obj in jsonl_rows(path, lines, expects):
        yield f"{path}: row {row_no}", obj


def check_label_set(label_set: Sequence[str]) -> list[str]:
    if isinstance(label_set, str) or not label_set:
        raise ConfigError(f"label_set must be a non-empty list of label names, got {label_set!r}")
    labels = list(label_set)
    if len(set(labels)) != len(labels) or not all(isinstance(x, str) and x for x in labels):
        raise ConfigError(f"label_set must hold unique non-empty strings, got {labels!r}")
    return labels


def fmt_labels(labels: Sequence[str], limit: int = 30) -> str:
    shown = ", ".join(repr(x) for x in labels[:limit])
    return f"[{shown}{', ...' if len(labels) > limit else ''}]"


def parse_labels(raw: Any, where: str, label_field: str, fmt: str, allowed: set[str]) -> list[str]:
    """Normalise a raw label value to a list of label strings (empty = missing)."""
    if raw is None:
        return []
    if isinstance(raw, bool) or isinstance(raw, float):
        raise DatasetError(f"{where}: label {raw!r} in field {label_field!r} must be a label name (string)",
                           rule="a label is not a label name (string)", row=row_in(where))
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
                                   "strings", rule="a label is not a label name (string)", row=row_in(where))
            if str(item).strip():
                out.append(str(item).strip())
        return out
    raise DatasetError(f"{where}: label field {label_field!r} must be a string or a list of strings, "
                       f"got {type(raw).__name__}", rule="the label field is neither a label nor a list of labels",
                       row=row_in(where))


def open_text(path: str | os.PathLike[str]):
    try:
        return open(path, encoding="utf-8-sig", newline="")
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found; check the dataset path in the site configuration",
                           rule="the dataset file is missing") from None
    except IsADirectoryError:
        raise DatasetError(f"{path}: is a directory, not a dataset file",
                           rule="the dataset path is not a file") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable file ({exc.strerror or exc}); check the path and its "
                           "permissions", rule="the dataset file cannot be read") from None


def decode_guard(path, fn):
    try:
        return fn()
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: unreadable file: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                           "save it as UTF-8",
                           rule="the dataset file is not valid UTF-8") from None
    except OSError as exc:
        raise DatasetError(f"{path}: unreadable file ({exc}); check the path and its permissions",
                           rule="the dataset file cannot be read") from None


