"""Site dataset readers for the NER (token classification) family, with schema validation.

An NER dataset is a JSONL or CoNLL file; either way each example is a text with character-offset entity spans:

* JSONL (``.jsonl`` / ``.ndjson``): one JSON object per line,
  ``{"text": "...", "entities": [{"start": 0, "end": 9, "label": "DRUG"}, ...]}``. An entity may also be a
  3-item list ``[start, end, label]``. Offsets are Python ``str`` indices (code points), ``start`` inclusive and
  ``end`` exclusive. A missing (or null) entities field means the text has no entities, as does an empty list:
  sentences without entities are valid training data. Blank lines are skipped.
* CoNLL (``.conll`` / ``.bio`` / ``.iob`` / ``.txt``): one token per line, columns separated by tabs or spaces;
  the first column is the token and the last is its tag (middle columns, e.g. part of speech, are ignored). A
  blank line ends a sentence and ``-DOCSTART-`` lines are skipped (they end a sentence too). Tags are ``O`` or
  ``PREFIX-TYPE`` with PREFIX one of ``B I E S``, so BIO, IOB1, IOB2 and BIOES files all read. The example text
  is the tokens joined by single spaces; entities are chunked leniently as conlleval does: ``B-`` and ``S-``
  start an entity, ``I-``/``E-`` continue the previous entity when it has the same type and is still open, and
  start a new one otherwise; ``E-`` and ``S-`` close it.

Every problem raises :class:`~fedclinic.errors.DatasetError` naming the file, the 1-based row (JSONL) or line
(CoNLL; rows are lines there) and what to do about it. Nothing is read lazily: a file that passes is fully
valid, and every returned example has its entities sorted by start and non-overlapping.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fedclinic.data.files import check_label_set, decode_guard, fmt_labels, open_text, jsonl_objects, require_text
from fedclinic.errors import DatasetError
from fedclinic.data.ner_tags import tags_to_spans

NER_FORMATS = ("jsonl", "conll")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".conll": "conll", ".bio": "conll", ".iob": "conll",
             ".txt": "conll"}
_PREFIXES = ("B", "I", "E", "S")
# Only real line breaks end a line: a JSON string may hold U+2028 and friends, which str.splitlines would split on.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_DOCSTART = "-DOCSTART-"


@dataclass(frozen=True)
class EntitySpan:
    """One entity: ``text[start:end]`` (character offsets, end exclusive) has type ``label``."""

    start: int
    end: int
    label: str


@dataclass(frozen=True)
class NerExample:
    """One text and its entities, sorted by start and non-overlapping (possibly none)."""

    text: str
    entities: tuple[EntitySpan, ...]


def infer_ner_format(path: str | os.PathLike[str]) -> str:
    """'jsonl' / 'conll' from the file suffix (.jsonl/.ndjson; .conll/.bio/.iob/.txt)."""
    suffix = Path(path).suffix.lower()
    try:
        return _SUFFIXES[suffix]
    except KeyError:
        raise DatasetError(f"{path}: cannot tell the NER dataset format from the suffix {suffix!r}; rename the "
                           f"file to .jsonl/.ndjson or .conll/.bio/.iob/.txt or pass format= one of "
                           f"{', '.join(NER_FORMATS)}") from None


def read_ner(
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    label_set: Sequence[str],
    text_field: str = "text",
    entities_field: str = "entities",
) -> list[NerExample]:
    """Read and validate an NER dataset; returns its examples in file order.

    ``label_set`` holds the entity types (e.g. ``["DRUG", "DOSE"]``), not BIO tags. ``text_field`` and
    ``entities_field`` name the JSONL fields; CoNLL files have no field names.
    """
    labels = check_label_set(label_set)
    fmt = (format or "").lower() or infer_ner_format(path)
    if fmt not in NER_FORMATS:
        raise DatasetError(f"{path}: unknown NER dataset format {format!r}; use one of {', '.join(NER_FORMATS)}")
    lines = _read_lines(path)
    out = (_read_jsonl(path, lines, labels, text_field, entities_field) if fmt == "jsonl"
           else _read_conll(path, lines, labels))
    if not out:
        what = "no example rows" if fmt == "jsonl" else "no sentences: no token lines"
        raise DatasetError(f"{path}: the dataset is empty ({what}); point the site at a file with data")
    return out


def _read_lines(path) -> list[str]:
    with open_text(path) as fh:
        content = decode_guard(path, fh.read)
    return _LINE_BREAK.split(content)


# ------------------------------------------------------------------------------------------------ JSONL


def _read_jsonl(path, lines: list[str], labels: list[str], text_field: str,
                entities_field: str) -> list[NerExample]:
    allowed = set(labels)
    out: list[NerExample] = []
    for where, obj in jsonl_objects(path, lines, f"{text_field!r} and {entities_field!r}"):
        text = require_text(obj.get(text_field), where, text_field, "the text to tag")
        raw = obj.get(entities_field)
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise DatasetError(f"{where}: entities field {entities_field!r} must be a list of entities (use [] "
                               f"for a text without entities), got {type(raw).__name__}")
        spans = [_parse_entity(item, i, text, where, entities_field, labels, allowed)
                 for i, item in enumerate(raw, start=1)]
        spans.sort(key=lambda s: (s.start, s.end))
        for prev, cur in zip(spans, spans[1:]):
            if cur.start < prev.end:
                raise DatasetError(f"{where}: overlapping entities {_describe(prev, text)} and "
                                   f"{_describe(cur, text)}; entities must not overlap: keep one of them or "
                                   "fix the offsets")
        out.append(NerExample(text=text, entities=tuple(spans)))
    return out


def _parse_entity(item: Any, index: int, text: str, where: str, entities_field: str, labels: list[str],
                  allowed: set[str]) -> EntitySpan:
    shape = ('{"start": <int>, "end": <int>, "label": "<type>"} or a list [start, end, label]')
    at = f"{where}: entity {index} in field {entities_field!r}"
    if isinstance(item, dict):
        missing = [k for k in ("start", "end", "label") if k not in item]
        if missing:
            raise DatasetError(f"{at} is malformed: no {', '.join(repr(k) for k in missing)} in {item!r}; "
                               f"write each entity as {shape}")
        start, end, label = item["start"], item["end"], item["label"]
    elif isinstance(item, list):
        if len(item) != 3:
            raise DatasetError(f"{at} is malformed: a list entity needs exactly 3 items [start, end, label], got "
                               f"{len(item)} in {item!r}")
        start, end, label = item
    else:
        raise DatasetError(f"{at} is malformed: got {type(item).__name__} {item!r}; write each entity as {shape}")
    for name, value in (("start", start), ("end", end)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DatasetError(f"{at}: {name} must be an integer character offset, got {value!r}")
    if not isinstance(label, str) or not label:
        raise DatasetError(f"{at} is malformed: label must be a non-empty string (the entity type), got "
                           f"{label!r}")
    if start < 0:
        raise DatasetError(f"{at}: start {start} is negative; offsets count characters from 0")
    if end > len(text):
        raise DatasetError(f"{at}: end {end} is past the end of the text ({len(text)} characters); offsets are "
                           "character (code point) indices into the text, end exclusive")
    if start >= end:
        raise DatasetError(f"{at}: start {start} must be less than end {end} (end is exclusive); fix the "
                           "offsets or remove the empty entity")
    span = text[start:end]
    if not span.strip():
        raise DatasetError(f"{at}: the span [{start}, {end}) {span!r} is only whitespace; remove the entity or "
                           "fix its offsets")
    if span != span.strip():
        lead = len(span) - len(span.lstrip())
        trail = len(span) - len(span.rstrip())
        raise DatasetError(f"{at}: the span [{start}, {end}) {span!r} has leading or trailing whitespace; trim "
                           f"it to [{start + lead}, {end - trail}) {span.strip()!r}")
    if label not in allowed:
        raise DatasetError(f"{at}: unknown label {label!r}; allowed labels are {fmt_labels(labels)} (fix the "
                           "row or add the label to the task's label set)")
    return EntitySpan(start=start, end=end, label=label)


def _describe(span: EntitySpan, text: str) -> str:
    return f"[{span.start}, {span.end}) {span.label!r} {text[span.start:span.end]!r}"


# ------------------------------------------------------------------------------------------------ CoNLL


def _read_conll(path, lines: list[str], labels: list[str]) -> list[NerExample]:
    allowed = set(labels)
    out: list[NerExample] = []
    tokens: list[str] = []
    tags: list[tuple[str, str]] = []  # (prefix or "O", type or "")

    def flush() -> None:
        if tokens:
            out.append(_conll_example(tokens, tags))
            tokens.clear()
            tags.clear()

    for line_no, line in enumerate(lines, start=1):
        cols = line.split()
        if not cols:
            flush()
            continue
        if cols[0].startswith(_DOCSTART):
            flush()
            continue
        where = f"{path}: line {line_no}"
        if len(cols) == 1:
            raise DatasetError(f"{where}: only one column ({cols[0]!r}); each line needs the token and its tag "
                               "separated by a tab or spaces (the tag is the last column), or is blank to end "
                               "a sentence")
        tag = cols[-1]
        if tag == "O":
            tags.append(("O", ""))
        else:
            prefix, sep, etype = tag.partition("-")
            if not sep or prefix not in _PREFIXES or not etype:
                raise DatasetError(f"{where}: unknown tag {tag!r}; a tag is O or B-/I-/E-/S- followed by the "
                                   "entity type (e.g. B-DRUG); fix the tag or convert the file to BIO/BIOES")
            if etype not in allowed:
                raise DatasetError(f"{where}: unknown label {etype!r} in tag {tag!r}; allowed labels are "
                                   f"{fmt_labels(labels)} (fix the line or add the label to the task's label "
                                   "set)")
            tags.append((prefix, etype))
        tokens.append(cols[0])
    flush()
    return out


def _conll_example(tokens: list[str], tags: list[tuple[str, str]]) -> NerExample:
    """Tokens joined by single spaces; entities chunked by :func:`fedclinic.data.ner_tags.tags_to_spans` (the one
    chunking implementation), which reads every B/I/E/S file under the BIOES prefixes."""
    offsets = []
    pos = 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok) + 1
    names = ["O" if prefix == "O" else f"{prefix}-{etype}" for prefix, etype in tags]
    spans = tuple(EntitySpan(start=offsets[first], end=offsets[last - 1] + len(tokens[last - 1]), label=etype)
                  for etype, first, last in tags_to_spans(names, "BIOES"))
    return NerExample(text=" ".join(tokens), entities=spans)
