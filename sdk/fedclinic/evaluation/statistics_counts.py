"""What a site measures for federated statistics: its rows, their labels, lengths and tokenizer coverage.

:func:`measure` turns a site's examples (and the bad rows its reader skipped, :class:`RowProblems`) into
:class:`SiteCounts`, the exact per-row measurements that :mod:`fedclinic.evaluation.statistics` releases (exactly,
or through :mod:`fedclinic.evaluation.statistics_dp`'s noise). Nothing here leaves the site.

Row classes (every row of the dataset file is exactly one of them):

- **valid** (``rows``): a text and at least one label, every label in the task's label set (one label in a
  single-label task); what training reads;
- **missing** (``missing_rows``): the text or the label is absent, empty or only whitespace;
- **invalid** (``invalid_rows``): anything else the reader refuses -- a row that does not parse (bad JSON, not a
  JSON object, a malformed CSV/TSV row), a text that is not a string, a label that is not in the task's label set
  or not a label name, several labels in a single-label task.

Tokens: each valid text is encoded by the task's tokenizer (a ``tokenizers.Tokenizer`` from the model's
``tokenizer.json``, or a ``transformers`` fast tokenizer) with its special tokens, as the model reads it.
``tokens`` per row counts them all (what ``max_length`` truncates); ``content`` leaves out the special tokens the
post-processor adds ([CLS], [SEP]); ``unk`` counts the content tokens that are the tokenizer model's unknown
token (0 for a tokenizer without one, e.g. byte-level BPE, which has no unknown input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Sequence

import numpy as np

from fedclinic.errors import DatasetError

#: the reader's rules (fedclinic.data) that make a row *missing*; every other row-level rule makes it *invalid*
MISSING_RULES = frozenset({"the text field is missing", "the text is empty", "the label is missing"})
#: max_length of a spec that leaves it 0 (fedclinic.spec.task.Task's default)
DEFAULT_MAX_LENGTH = 128
_KEY_SAFE = re.compile(r"[\x20-\x7e]+")
MAX_KEY_CHARS = 200
#: a multi-label task with more labels reports no label pairs: L(L-1)/2 pair keys would pass the transport's
#: 8,192 keys per site result (90 labels: 4,005 pairs)
MAX_PAIR_LABELS = 90


@dataclass
class RowProblems:
    """The rows a tolerant reader skipped, by class; pass it as the reader's ``on_bad_row``
    (``fedclinic.data.text.read_classification``). Only counts are kept, never a row's content."""

    missing: int = 0
    invalid: int = 0

    def __call__(self, exc: DatasetError) -> None:
        if exc.rule in MISSING_RULES:
            self.missing += 1
        else:
            self.invalid += 1


@dataclass
class SiteCounts:
    """A site's exact measurements (see the module docstring). ``tokens``, ``content`` and ``unk`` are None when
    no tokenizer was given; ``pairs`` is empty for a single-label task."""

    labels_in_order: tuple[str, ...]
    multi_label: bool
    max_length: int
    rows: int = 0
    missing: int = 0
    invalid: int = 0
    labels: dict[str, int] = field(default_factory=dict)
    pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    chars: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    tokens: np.ndarray | None = None
    content: np.ndarray | None = None
    unk: np.ndarray | None = None
    #: the most labels one row can carry: 1 in a single-label task, every label in a multi-label one or for NER
    #: rows (a row carries each entity type it holds); what the label counts' sensitivity is built on
    labels_per_row: int = 1


def label_key(label: str, index: int) -> str:
    """The values key of a label: ``label/<label>``, or ``label/#<index>`` when the name is not printable ASCII or
    would make a key longer than 200 characters (the transport's key contract)."""
    return f"label/{label}" if _fits(label, len("label/")) else f"label/#{index}"


def pair_key(a: str, ia: int, b: str, ib: int) -> str:
    """The values key of a co-occurring label pair (``a`` before ``b`` in label order): ``label_pair/<a>|<b>``, or
    ``label_pair/#<ia>|#<ib>`` when a name is not printable ASCII, holds ``|`` or makes the key too long."""
    if _fits(a, len("label_pair/|") + len(b)) and _fits(b, 0) and "|" not in a + b:
        return f"label_pair/{a}|{b}"
    return f"label_pair/#{ia}|#{ib}"


def _fits(name: str, prefix: int) -> bool:
    return bool(_KEY_SAFE.fullmatch(name)) and prefix + len(name) <= MAX_KEY_CHARS


def with_pairs(labels: Sequence[str], multi_label: bool) -> bool:
    """Whether a task's statistics count label pairs: multi-label with at most :data:`MAX_PAIR_LABELS` labels."""
    return multi_label and len(labels) <= MAX_PAIR_LABELS


def label_keys(labels: Sequence[str], multi_label: bool) -> list[str]:
    """Every label (and, multi-label, label-pair: :func:`with_pairs`) key of a task, in label order."""
    keys = [label_key(lab, i) for i, lab in enumerate(labels)]
    if with_pairs(labels, multi_label):
        keys += [pair_key(a, i, b, j) for (i, a), (j, b) in combinations(enumerate(labels), 2)]
    return keys


def measure(examples: Sequence[Any], tokenizer: Any, labels: Sequence[str], *, multi_label: bool, max_length: int,
            problems: RowProblems | None = None) -> SiteCounts:
    """The site's :class:`SiteCounts`. Each example has ``text`` and ``labels`` (text and image-text
    classification) or ``entities`` with a ``label`` each (NER: a row carries the entity types it holds); an
    example the reader passed is classified again against ``labels`` (a caller may build examples by hand)."""
    labels = tuple(labels)
    allowed = set(labels)
    counts = SiteCounts(labels, multi_label, max_length or DEFAULT_MAX_LENGTH,
                        missing=problems.missing if problems else 0, invalid=problems.invalid if problems else 0)
    counts.labels = {lab: 0 for lab in labels}
    if with_pairs(labels, multi_label):
        counts.pairs = {pair: 0 for pair in combinations(labels, 2)}
    order = {lab: i for i, lab in enumerate(labels)}
    texts: list[str] = []
    examples = list(examples)
    if multi_label or any(hasattr(ex, "entities") for ex in examples):
        counts.labels_per_row = len(labels)
    for ex in examples:
        text = getattr(ex, "text", None)
        row_labels = _row_labels(ex)
        if text is None or (isinstance(text, str) and not text.strip()) or (not row_labels and labels and
                                                                              not hasattr(ex, "entities")):
            counts.missing += 1
            continue
        if not isinstance(text, str) or any(lab not in allowed for lab in row_labels) or (
                not multi_label and len(row_labels) > 1 and not hasattr(ex, "entities")):
            counts.invalid += 1
            continue
        found = sorted(set(row_labels), key=order.__getitem__)
        for lab in found:
            counts.labels[lab] += 1
        if counts.pairs:
            for pair in combinations(found, 2):
                counts.pairs[pair] += 1
        texts.append(text)
    counts.rows = len(texts)
    counts.chars = np.array([len(t) for t in texts], np.int64)
    if tokenizer is not None:
        counts.tokens, counts.content, counts.unk = _token_counts(tokenizer, texts)
    return counts


def _row_labels(ex: Any) -> tuple[str, ...]:
    found = getattr(ex, "labels", None)
    if found is not None:
        return tuple(found)
    entities = getattr(ex, "entities", None)
    return tuple(e.label for e in entities) if entities is not None else ()


def backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of a tokenizer (itself, or a ``transformers`` fast tokenizer's backend)."""
    return getattr(tokenizer, "backend_tokenizer", tokenizer)


def unknown_id(tokenizer: Any) -> int | None:
    """The id of the tokenizer model's unknown token, or None when its model has none (byte-level BPE)."""
    tok = backend(tokenizer)
    name = getattr(tok.model, "unk_token", None)
    if name:
        return tok.token_to_id(name)
    idx = getattr(tok.model, "unk_id", None)  # Unigram
    return int(idx) if isinstance(idx, int) else None


def _token_counts(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tok = backend(tokenizer)
    tok.no_truncation()  # the full length: truncation is what is measured
    encs = tok.encode_batch_fast(texts) if texts else []
    unk = unknown_id(tok)
    tokens = np.array([len(e.ids) for e in encs], np.int64)
    special = np.array([sum(e.special_tokens_mask) for e in encs], np.int64)
    unks = np.array([sum(1 for i in e.ids if i == unk) if unk is not None else 0 for e in encs], np.int64)
    return tokens, tokens - special, unks


def unk_rate(tokenizer: Any, texts: Sequence[str]) -> float:
    """The share of the content tokens of ``texts`` that are the tokenizer's unknown token (0.0 for no tokens):
    the coverage a site reports when it accepts a training task (``tokenizer_unk_rate``)."""
    _, content, unks = _token_counts(tokenizer, list(texts))
    total = int(content.sum())
    return float(unks.sum()) / total if total else 0.0


__all__ = ["DEFAULT_MAX_LENGTH", "MISSING_RULES", "RowProblems", "SiteCounts", "backend", "label_key", "label_keys",
           "measure", "pair_key", "unk_rate", "unknown_id"]


# ------------------------------------------------------------------------------------------------------------
# what a release derives from its counts (the exact release, the noisy one and the pool alike)

#: the text length quantiles reported, in percent (keys chars_q05 ... tokens_q95)
QUANTILES = (5, 25, 50, 75, 95)
#: the sums behind the rates: truncated rows, content tokens, unknown tokens, characters
SUM_KEYS = ("count/truncated_rows", "count/tokens", "count/unk_tokens", "count/chars")


def quantile_keys(prefix: str) -> list[str]:
    """``<prefix>_q05`` ... ``<prefix>_q95`` (prefix "chars" or "tokens")."""
    return [f"{prefix}_q{pp:02d}" for pp in QUANTILES]


def add_rates(values: dict[str, float]) -> None:
    """Write ``truncated_rate`` = truncated rows / rows, ``unk_rate`` = unknown tokens / content tokens and
    ``tokens_per_char`` = content tokens / characters into ``values`` from its sums, where they are present and the
    denominator is positive (a rate is clipped to [0, 1], as noisy sums may leave it)."""
    def ratio(num: str, den: str, name: str, clip: bool) -> None:
        if num in values and values.get(den, 0) > 0:
            r = max(0.0, values[num] / values[den])
            values[name] = min(1.0, r) if clip else r
    ratio("count/truncated_rows", "rows", "truncated_rate", True)
    ratio("count/unk_tokens", "count/tokens", "unk_rate", True)
    ratio("count/tokens", "count/chars", "tokens_per_char", False)
