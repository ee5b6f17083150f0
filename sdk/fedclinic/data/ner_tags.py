"""Tag schemes and entity-level metrics for the NER model family (the one implementation; reuse it).

Three representations of the same annotation:

- **character spans** ``(start_char, end_char_exclusive, type)``: what datasets store and serving returns;
- **token tags** (``"O"``, ``"B-T"``, ``"I-T"``, and for BIOES also ``"E-T"``, ``"S-T"``): what the model
  predicts, one per token;
- **token entities** ``(type, start_token, end_token_exclusive)``: what the metrics compare.

:func:`spans_to_token_tags` turns character spans into training labels, :func:`tags_to_spans` decodes
predicted tags into entities with the lenient chunking of ``conlleval`` / ``seqeval``'s default mode, and
:func:`token_spans_to_char_spans` maps those entities back to characters. :func:`entity_scores` computes
strict (exact match) and relaxed (same type, overlapping) precision, recall and F1, micro-averaged over all
sentences; the strict numbers equal ``seqeval.metrics.{precision,recall,f1}_score`` (default mode) on the
same BIO tag lists.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from typing import Sequence

from fedclinic.errors import ConfigError, DatasetError

#: Supported tag schemes. BIO (a.k.a. IOB2) uses B-/I-; BIOES adds E- (last token) and S- (single token).
SCHEMES = ("BIO", "BIOES")

_PREFIXES = {"BIO": ("B", "I"), "BIOES": ("B", "I", "E", "S")}

Entity = tuple[str, int, int]
CharSpan = tuple[int, int, str]


def _check_scheme(scheme: str) -> tuple[str, ...]:
    """Return the tag prefixes of ``scheme``; ConfigError when it is not one of :data:`SCHEMES`."""
    if scheme not in _PREFIXES:
        raise ConfigError(f"unknown NER tag scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    return _PREFIXES[scheme]


def tag_set(entity_types: Sequence[str], scheme: str = "BIO") -> list[str]:
    """All tags of ``scheme`` for ``entity_types``: ``"O"`` first, then each type in the given order.

    BIO gives ``B-T, I-T`` per type; BIOES gives ``B-T, I-T, E-T, S-T``. The position of a tag in this list
    is its label id, so the order is part of the contract. ConfigError on an unknown scheme, an empty list,
    a duplicate type, or a type that is empty, contains whitespace or is ``"O"``.
    """
    prefixes = _check_scheme(scheme)
    if isinstance(entity_types, str):
        raise ConfigError(f"entity_types must be a list of type names, not the string {entity_types!r}; "
                          f"write [{entity_types!r}]")
    types = list(entity_types)
    if not types:
        raise ConfigError("entity_types is empty; list at least one entity type, e.g. [\"PROBLEM\", \"DRUG\"]")
    seen: set[str] = set()
    for t in types:
        if not isinstance(t, str) or not t:
            raise ConfigError(f"entity type {t!r} is not a non-empty string; name every type, e.g. \"DRUG\"")
        if any(c.isspace() for c in t):
            raise ConfigError(f"entity type {t!r} contains whitespace; use e.g. {'_'.join(t.split())!r}")
        if t == "O":
            raise ConfigError("entity type 'O' collides with the outside tag 'O'; rename that type")
        if t in seen:
            raise ConfigError(f"entity type {t!r} is listed twice; list each type once")
        seen.add(t)
    return ["O"] + [f"{p}-{t}" for t in types for p in prefixes]


def _check_offsets(token_offsets: Sequence[tuple[int, int]]) -> None:
    for i, (s, e) in enumerate(token_offsets):
        if s < 0 or e < s:
            raise DatasetError(f"token {i} has character offsets ({s}, {e}); offsets must satisfy "
                               "0 <= start <= end (use (0, 0) for special and padding tokens)")


def _sorted_spans(spans: Sequence[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Spans sorted by start; DatasetError on an empty, negative, untyped or overlapping span."""
    for s, e, t in spans:
        if s < 0 or e <= s:
            raise DatasetError(f"entity span ({s}, {e}, {t!r}) is empty or negative; a span is "
                               "(start_char, end_char_exclusive, type) with start < end")
        if not isinstance(t, str) or not t:
            raise DatasetError(f"entity span ({s}, {e}, {t!r}) has no type; give every span a type name")
    out = sorted((int(s), int(e), t) for s, e, t in spans)
    for (s1, e1, t1), (s2, e2, t2) in zip(out, out[1:]):
        if s2 < e1:
            raise DatasetError(f"entity spans ({s1}, {e1}, {t1!r}) and ({s2}, {e2}, {t2!r}) overlap; nested or "
                               "overlapping entities cannot be tagged, keep one of them")
    return out


def spans_to_token_tags(token_offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int, str]],
                        scheme: str = "BIO") -> list[str]:
    """One tag per token for character-level entity ``spans``.

    ``token_offsets[i] = (start_char, end_char_exclusive)`` of token ``i``; a token with ``start == end``
    (``[CLS]``, ``[SEP]``, padding) always gets ``"O"``. ``spans`` are non-overlapping
    ``(start_char, end_char_exclusive, type)``. A token belongs to a span when its character range overlaps
    ``[start, end)``; a token that overlaps two spans belongs to the earlier one. The first token of a span
    gets ``B-``, the others ``I-``; with BIOES a one-token span gets ``S-`` and the last token ``E-``. A span
    that covers no token (truncated away, or inside whitespace) produces no tags.

    When tokens are in text order and do not overlap, ``tags_to_spans`` of the result gives back, per span,
    the range of tokens it overlaps. DatasetError on malformed offsets or spans, ConfigError on an unknown
    scheme.
    """
    _check_scheme(scheme)
    _check_offsets(token_offsets)
    ordered = _sorted_spans(spans)
    ends = [e for _, e, _ in ordered]  # non-decreasing because spans are sorted and disjoint
    owner: list[int | None] = []
    for ts, te in token_offsets:
        k = bisect_right(ends, ts)  # first span ending after the token starts
        owner.append(k if ts < te and k < len(ordered) and ordered[k][0] < te else None)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, k in enumerate(owner):
        if k is not None:
            first.setdefault(k, i)
            last[k] = i
    tags: list[str] = []
    for i, k in enumerate(owner):
        if k is None:
            tags.append("O")
            continue
        t = ordered[k][2]
        is_first, is_last = first[k] == i, last[k] == i
        if scheme == "BIOES" and is_first and is_last:
            tags.append(f"S-{t}")
        elif is_first:
            tags.append(f"B-{t}")
        elif scheme == "BIOES" and is_last:
            tags.append(f"E-{t}")
        else:
            tags.append(f"I-{t}")
    return tags


def _parse_tag(tag: str, prefixes: tuple[str, ...], scheme: str) -> tuple[str, str]:
    """``"B-DRUG"`` -> ``("B", "DRUG")``; ``"O"`` -> ``("O", "")``. The type is everything after the first ``-``."""
    if tag == "O":
        return "O", ""
    prefix, sep, typ = tag.partition("-") if isinstance(tag, str) else ("", "", "")
    if not sep or prefix not in prefixes or not typ:
        raise ConfigError(f"unknown tag {tag!r} for scheme {scheme}; tags are 'O' or "
                          f"{'/'.join(prefixes)}-<type> (decode with the scheme the model was trained with)")
    return prefix, typ


def tags_to_spans(tags: Sequence[str], scheme: str = "BIO") -> list[Entity]:
    """Entities ``(type, start_token, end_token_exclusive)`` in ``tags``, in order.

    Lenient chunking, the semantics of ``conlleval`` and ``seqeval``'s default mode: ``B-`` always starts
    an entity; ``I-`` continues the open entity of the same type and otherwise (after ``O``, after an entity
    of another type, after a closed ``E-``/``S-``) starts a new one; ``E-`` ends the open entity of its type,
    or is a one-token entity when none is open; ``S-`` is a one-token entity; ``O`` closes the open entity.
    ConfigError naming the tag when a tag is not ``"O"`` or a prefix of ``scheme`` followed by ``-<type>``.
    """
    prefixes = _check_scheme(scheme)
    entities: list[Entity] = []
    open_type: str | None = None
    open_start = 0

    def close(end: int) -> None:
        nonlocal open_type
        if open_type is not None:
            entities.append((open_type, open_start, end))
            open_type = None

    for i, tag in enumerate(tags):
        prefix, typ = _parse_tag(tag, prefixes, scheme)
        continues = open_type == typ and prefix in ("I", "E")
        if not continues:
            close(i)
            if prefix != "O":
                open_type, open_start = typ, i
        if prefix in ("E", "S"):
            close(i + 1)
    close(len(tags))
    return entities


def token_spans_to_char_spans(entities: Sequence[Entity],
                              token_offsets: Sequence[tuple[int, int]]) -> list[CharSpan]:
    """Map token entities back to characters: ``(type, s, e)`` -> ``(offsets[s][0], offsets[e-1][1], type)``.

    Tokens with empty offsets (special and padding tokens) at either end of an entity are skipped first, so
    a prediction that spills onto ``[CLS]`` or ``[SEP]`` still maps to the text; an entity made only of
    such tokens is dropped. DatasetError when an entity is empty or lies outside ``token_offsets`` (tags and
    offsets come from different encodings).
    """
    _check_offsets(token_offsets)
    out: list[CharSpan] = []
    n = len(token_offsets)
    for typ, s, e in entities:
        if not 0 <= s < e <= n:
            raise DatasetError(f"entity ({typ!r}, {s}, {e}) does not fit {n} token offsets; decode the tags of "
                               "the same encoding whose offsets you pass")
        while s < e and token_offsets[s][0] == token_offsets[s][1]:
            s += 1
        while e > s and token_offsets[e - 1][0] == token_offsets[e - 1][1]:
            e -= 1
        if s < e:
            out.append((token_offsets[s][0], token_offsets[e - 1][1], typ))
    return out


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def _f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r) if p + r else 0.0


def _overlaps(a: Entity, others: Sequence[Entity]) -> bool:
    return any(a[0] == b[0] and a[1] < b[2] and b[1] < a[2] for b in others)


def entity_scores(gold: Sequence[Sequence[Entity]], pred: Sequence[Sequence[Entity]]) -> dict[str, float]:
    """Entity-level precision, recall and F1, micro-averaged over all sentences.

    ``gold[i]`` and ``pred[i]`` are the entities ``(type, start_token, end_token_exclusive)`` of sentence
    ``i`` (e.g. from :func:`tags_to_spans`); ValueError when the two have different lengths.

    - ``strict_*``: a predicted entity is correct only when the same ``(type, start, end)`` is in the gold
      entities of its sentence (equal to seqeval's default-mode micro scores);
    - ``relaxed_precision``: share of predicted entities that overlap at least one gold entity of the same
      type in the same sentence; ``relaxed_recall``: share of gold entities overlapped by at least one
      predicted entity of the same type; ``relaxed_f1``: their harmonic mean;
    - ``gold_entities``, ``pred_entities``: the counts, as floats.

    A zero denominator gives 0.0 (seqeval's ``zero_division=0``).
    """
    if len(gold) != len(pred):
        raise ValueError(f"gold has {len(gold)} sentences but pred has {len(pred)}; pass one entity list per "
                         "sentence in both")
    n_gold = n_pred = tp = rel_pred = rel_gold = 0
    for g, p in zip(gold, pred):
        g, p = [tuple(x) for x in g], [tuple(x) for x in p]
        n_gold += len(g)
        n_pred += len(p)
        tp += sum((Counter(g) & Counter(p)).values())
        rel_pred += sum(_overlaps(x, g) for x in p)
        rel_gold += sum(_overlaps(x, p) for x in g)
    sp, sr = _ratio(tp, n_pred), _ratio(tp, n_gold)
    rp, rr = _ratio(rel_pred, n_pred), _ratio(rel_gold, n_gold)
    return {
        "strict_precision": sp, "strict_recall": sr, "strict_f1": _f1(sp, sr),
        "relaxed_precision": rp, "relaxed_recall": rr, "relaxed_f1": _f1(rp, rr),
        "gold_entities": float(n_gold), "pred_entities": float(n_pred),
    }
