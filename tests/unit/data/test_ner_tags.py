"""fedclinic.data.ner_tags: tag schemes, span/tag conversion, entity metrics (strict ones checked against seqeval)."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.metrics.sequence_labeling import get_entities

from fedclinic.errors import ConfigError, DatasetError, FedclinicError
from fedclinic.data.ner_tags import (
    SCHEMES,
    entity_scores,
    spans_to_token_tags,
    tag_set,
    tags_to_spans,
    token_spans_to_char_spans,
)

SETTINGS = settings(max_examples=200, deadline=None)
TYPES = ["DRUG", "PROBLEM", "X-Y"]  # "X-Y": a type name containing the separator


# ---------------------------------------------------------------- tag_set


def test_tag_set_order():
    assert tag_set(["DRUG", "PROBLEM"]) == ["O", "B-DRUG", "I-DRUG", "B-PROBLEM", "I-PROBLEM"]
    assert tag_set(["PROBLEM", "DRUG"], "BIOES") == [
        "O", "B-PROBLEM", "I-PROBLEM", "E-PROBLEM", "S-PROBLEM", "B-DRUG", "I-DRUG", "E-DRUG", "S-DRUG"]
    assert SCHEMES == ("BIO", "BIOES")


@pytest.mark.parametrize(("types", "scheme", "needle"), [
    (["DRUG"], "IOB1", "IOB1"),
    (["DRUG"], "bioes", "bioes"),
    ([], "BIO", "empty"),
    (["DRUG", "DRUG"], "BIO", "twice"),
    (["DRUG NAME"], "BIO", "whitespace"),
    (["DRUG\tNAME"], "BIO", "whitespace"),
    (["O"], "BIO", "'O'"),
    ([""], "BIO", "non-empty"),
    ("DRUG", "BIO", "list"),
])
def test_tag_set_errors(types, scheme, needle):
    with pytest.raises(ConfigError, match=needle):
        tag_set(types, scheme)


# ---------------------------------------------------------------- spans -> tags

# "Aspirin 81 mg for chest pain" tokenized as [CLS] Asp ##irin 81 mg for chest pain [SEP] [PAD]
TEXT = "Aspirin 81 mg for chest pain"
OFFSETS = [(0, 0), (0, 3), (3, 7), (8, 10), (11, 13), (14, 17), (18, 23), (24, 28), (0, 0), (0, 0)]
SPANS = [(0, 13, "DRUG"), (18, 28, "PROBLEM")]


def test_spans_to_tags_by_hand():
    assert TEXT[0:13] == "Aspirin 81 mg" and TEXT[18:28] == "chest pain"
    assert spans_to_token_tags(OFFSETS, SPANS) == [
        "O", "B-DRUG", "I-DRUG", "I-DRUG", "I-DRUG", "O", "B-PROBLEM", "I-PROBLEM", "O", "O"]
    assert spans_to_token_tags(OFFSETS, SPANS, "BIOES") == [
        "O", "B-DRUG", "I-DRUG", "I-DRUG", "E-DRUG", "O", "B-PROBLEM", "E-PROBLEM", "O", "O"]
    # a span that starts inside a word tags the whole word; a one-token span is S- under BIOES
    assert spans_to_token_tags(OFFSETS, [(4, 6, "DRUG")], "BIOES")[2] == "S-DRUG"
    assert spans_to_token_tags(OFFSETS, [(4, 6, "DRUG")])[2] == "B-DRUG"
    # spans given out of order are fine
    assert spans_to_token_tags(OFFSETS, SPANS[::-1]) == spans_to_token_tags(OFFSETS, SPANS)


def test_spans_that_cover_no_token_produce_no_tags():
    truncated = OFFSETS[:4] + [(0, 0)]  # "Aspirin 81" then [SEP]: "mg ... pain" was truncated away
    assert spans_to_token_tags(truncated, SPANS) == ["O", "B-DRUG", "I-DRUG", "I-DRUG", "O"]
    assert spans_to_token_tags(OFFSETS, [(7, 8, "DRUG")]) == ["O"] * len(OFFSETS)  # only the space
    assert spans_to_token_tags(OFFSETS, []) == ["O"] * len(OFFSETS)
    assert spans_to_token_tags([], SPANS) == []


def test_token_overlapping_two_spans_goes_to_the_first():
    # one token "HIV-positive" (0, 12) but two annotated spans inside it
    tags = spans_to_token_tags([(0, 12), (13, 20)], [(0, 3, "PROBLEM"), (4, 12, "X-Y"), (13, 20, "X-Y")])
    assert tags == ["B-PROBLEM", "B-X-Y"]


@pytest.mark.parametrize(("offsets", "spans", "err", "needle"), [
    (OFFSETS, [(0, 13, "DRUG"), (12, 20, "PROBLEM")], DatasetError, "overlap"),
    (OFFSETS, [(5, 5, "DRUG")], DatasetError, "empty"),
    (OFFSETS, [(-1, 3, "DRUG")], DatasetError, "negative"),
    (OFFSETS, [(0, 3, "")], DatasetError, "no type"),
    ([(3, 1)], [], DatasetError, "offsets"),
    (OFFSETS, SPANS, ConfigError, "BILOU"),
])
def test_spans_to_tags_errors(offsets, spans, err, needle):
    scheme = "BILOU" if err is ConfigError else "BIO"
    with pytest.raises(err, match=needle):
        spans_to_token_tags(offsets, spans, scheme)


# ---------------------------------------------------------------- tags -> entities


@pytest.mark.parametrize(("tags", "scheme", "expected"), [
    (["B-A", "I-A", "O", "B-A"], "BIO", [("A", 0, 2), ("A", 3, 4)]),
    (["I-A", "I-A", "O", "I-A"], "BIO", [("A", 0, 2), ("A", 3, 4)]),  # I- after O starts an entity
    (["B-A", "I-B", "I-B"], "BIO", [("A", 0, 1), ("B", 1, 3)]),  # I- after another type starts one
    (["B-A", "B-A", "I-A"], "BIO", [("A", 0, 1), ("A", 1, 3)]),  # B- always starts one
    (["B-X-Y", "I-X-Y"], "BIO", [("X-Y", 0, 2)]),
    (["O", "O"], "BIO", []),
    ([], "BIO", []),
    (["B-A", "I-A", "E-A", "I-A"], "BIOES", [("A", 0, 3), ("A", 3, 4)]),  # I- after E- starts one
    (["E-A", "S-A", "E-A", "B-A", "E-B"], "BIOES",
     [("A", 0, 1), ("A", 1, 2), ("A", 2, 3), ("A", 3, 4), ("B", 4, 5)]),
    (["B-A", "E-A", "E-A"], "BIOES", [("A", 0, 2), ("A", 2, 3)]),
    (["S-A", "I-A", "E-A", "O"], "BIOES", [("A", 0, 1), ("A", 1, 3)]),
    (["B-A", "I-A"], "BIOES", [("A", 0, 2)]),  # an unterminated entity ends with the sentence
])
def test_tags_to_spans_by_hand(tags, scheme, expected):
    assert tags_to_spans(tags, scheme) == expected


@pytest.mark.parametrize(("tags", "scheme", "bad"), [
    (["O", "X-A"], "BIO", "X-A"),
    (["B-"], "BIO", "B-"),
    (["B"], "BIO", "B"),
    (["o"], "BIO", "o"),
    (["B-A", "E-A"], "BIO", "E-A"),  # E- is not a BIO tag
    (["S-A"], "BIO", "S-A"),
    (["L-A"], "BIOES", "L-A"),
])
def test_tags_to_spans_unknown_tag(tags, scheme, bad):
    with pytest.raises(ConfigError, match=f"'{bad}'"):
        tags_to_spans(tags, scheme)


def test_tags_to_spans_unknown_scheme():
    with pytest.raises(ConfigError, match="use one of BIO, BIOES"):
        tags_to_spans(["O"], "IOB")


def test_token_spans_to_char_spans():
    assert token_spans_to_char_spans([("DRUG", 1, 5), ("PROBLEM", 6, 8)], OFFSETS) == [
        (0, 13, "DRUG"), (18, 28, "PROBLEM")]
    # a prediction spilling onto [CLS]/[SEP] is trimmed to the text; one made only of specials is dropped
    assert token_spans_to_char_spans([("DRUG", 0, 2), ("PROBLEM", 7, 10), ("DRUG", 8, 10)], OFFSETS) == [
        (0, 3, "DRUG"), (24, 28, "PROBLEM")]
    with pytest.raises(DatasetError, match="does not fit 10 token offsets"):
        token_spans_to_char_spans([("DRUG", 9, 11)], OFFSETS)
    with pytest.raises(DatasetError):
        token_spans_to_char_spans([("DRUG", 3, 3)], OFFSETS)


# ---------------------------------------------------------------- round trips (property)


@st.composite
def annotated_tokens(draw):
    """Token offsets (with special tokens around) and char spans aligned to disjoint token ranges.

    Returns (offsets, char_spans, token_entities, aligned_char_spans).
    """
    n = draw(st.integers(0, 25))
    offsets, pos = [], 0
    for _ in range(n):
        pos += draw(st.integers(0, 2))  # whitespace before the token (0: a subword continuation)
        length = draw(st.integers(1, 6))
        offsets.append((pos, pos + length))
        pos += length
    lead = draw(st.integers(0, 2))
    trail = draw(st.integers(0, 3))
    full = [(0, 0)] * lead + offsets + [(0, 0)] * trail
    spans, entities, aligned, i = [], [], [], 0
    while i < n:
        i += draw(st.integers(0, 3))
        if i >= n:
            break
        j = min(n, i + draw(st.integers(1, 4)))
        typ = draw(st.sampled_from(TYPES))
        # the char span may start inside its first token and end inside its last one
        start = draw(st.integers(offsets[i][0], offsets[i][1] - 1))
        end = draw(st.integers(max(start + 1, offsets[j - 1][0] + 1), offsets[j - 1][1]))
        spans.append((start, end, typ))
        entities.append((typ, lead + i, lead + j))
        aligned.append((offsets[i][0], offsets[j - 1][1], typ))
        i = j
    return full, spans, entities, aligned


@SETTINGS
@given(data=annotated_tokens(), scheme=st.sampled_from(SCHEMES))
def test_round_trip_spans_tags_spans(data, scheme):
    offsets, spans, entities, aligned = data
    tags = spans_to_token_tags(offsets, spans, scheme)
    assert len(tags) == len(offsets)
    assert set(tags) <= set(tag_set(TYPES, scheme))
    assert all(t == "O" for t, (s, e) in zip(tags, offsets) if s == e)
    assert tags_to_spans(tags, scheme) == entities
    assert token_spans_to_char_spans(entities, offsets) == aligned
    # token-aligned spans are a fixed point
    assert spans_to_token_tags(offsets, aligned, scheme) == tags


@SETTINGS
@given(types=st.lists(st.sampled_from(TYPES), min_size=1, max_size=4, unique=True),
       data=st.data())
def test_round_trip_tags_spans_tags(types, data):
    """BIO tags that are already well formed (no I- after O or another type) survive decode + re-encode."""
    tags, prev = [], "O"
    for _ in range(data.draw(st.integers(0, 20))):
        choices = ["O"] + [f"B-{t}" for t in types] + ([f"I-{prev[2:]}"] if prev != "O" else [])
        prev = data.draw(st.sampled_from(choices))
        tags.append(prev)
    entities = tags_to_spans(tags)
    offsets = [(2 * k, 2 * k + 1) for k in range(len(tags))]
    spans = token_spans_to_char_spans(entities, offsets)
    assert spans_to_token_tags(offsets, spans) == tags


# ---------------------------------------------------------------- metrics by hand


def test_strict_vs_relaxed_by_hand():
    gold = [[("DRUG", 0, 2), ("PROBLEM", 4, 5)], [("DRUG", 1, 3)]]
    pred = [[("DRUG", 0, 1), ("PROBLEM", 4, 5), ("DRUG", 6, 7)], [("PROBLEM", 1, 3)]]
    s = entity_scores(gold, pred)
    # strict: only PROBLEM(4,5) matches exactly -> P = 1/4, R = 1/3, F1 = 2/7
    assert s["strict_precision"] == pytest.approx(1 / 4, abs=1e-12)
    assert s["strict_recall"] == pytest.approx(1 / 3, abs=1e-12)
    assert s["strict_f1"] == pytest.approx(2 / 7, abs=1e-12)
    # relaxed: DRUG(0,1) overlaps DRUG(0,2) and PROBLEM(4,5) counts; DRUG(6,7) overlaps nothing and
    # PROBLEM(1,3) overlaps only a DRUG -> P = 2/4; gold DRUG(0,2), PROBLEM(4,5) found -> R = 2/3; F1 = 4/7
    assert s["relaxed_precision"] == pytest.approx(1 / 2, abs=1e-12)
    assert s["relaxed_recall"] == pytest.approx(2 / 3, abs=1e-12)
    assert s["relaxed_f1"] == pytest.approx(4 / 7, abs=1e-12)
    assert s["gold_entities"] == 3.0 and s["pred_entities"] == 4.0
    assert all(isinstance(v, float) for v in s.values())


def test_relaxed_one_prediction_covering_two_gold():
    s = entity_scores([[("A", 0, 1), ("A", 2, 3)]], [[("A", 0, 3)]])
    assert (s["strict_precision"], s["strict_recall"], s["strict_f1"]) == (0.0, 0.0, 0.0)
    assert (s["relaxed_precision"], s["relaxed_recall"], s["relaxed_f1"]) == (1.0, 1.0, 1.0)


def test_relaxed_needs_real_overlap_in_the_same_sentence():
    # touching ranges do not overlap (ends are exclusive)
    s = entity_scores([[("A", 0, 2)]], [[("A", 2, 3)]])
    assert s["relaxed_precision"] == s["relaxed_recall"] == 0.0
    # the same positions in another sentence do not count
    s = entity_scores([[("A", 0, 2)], []], [[], [("A", 0, 2)]])
    assert s["strict_f1"] == s["relaxed_f1"] == 0.0
    assert s["gold_entities"] == s["pred_entities"] == 1.0


def test_zero_denominators_give_zero():
    keys = ["strict_precision", "strict_recall", "strict_f1", "relaxed_precision", "relaxed_recall",
            "relaxed_f1", "gold_entities", "pred_entities"]
    assert entity_scores([], []) == dict.fromkeys(keys, 0.0)
    s = entity_scores([[]], [[("A", 0, 1)]])
    assert s["strict_precision"] == s["strict_recall"] == s["strict_f1"] == 0.0
    assert s["relaxed_precision"] == s["relaxed_recall"] == s["relaxed_f1"] == 0.0
    assert s["pred_entities"] == 1.0
    s = entity_scores([[("A", 0, 1)]], [[]])
    assert s["strict_precision"] == s["relaxed_precision"] == s["relaxed_f1"] == 0.0


def test_entity_scores_length_mismatch():
    with pytest.raises(ValueError, match="2 sentences but pred has 1"):
        entity_scores([[], []], [[]])


def test_errors_are_fedclinic_errors():
    assert issubclass(ConfigError, FedclinicError) and issubclass(DatasetError, FedclinicError)


# ---------------------------------------------------------------- compatibility with seqeval (default mode)

BIO_TAGS = ["O", "O", "B-A", "I-A", "B-B", "I-B", "B-X-Y", "I-X-Y"]  # I- after O/other types is generated
BIOES_TAGS = BIO_TAGS + ["E-A", "S-A", "E-B", "S-B", "E-X-Y", "S-X-Y"]


@st.composite
def tag_corpora(draw, alphabet):
    """Gold and predicted tag lists for the same sentences (equal lengths per sentence)."""
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=6))
    if sum(lengths) == 0:
        lengths[0] = 1
    gold = [draw(st.lists(st.sampled_from(alphabet), min_size=n, max_size=n)) for n in lengths]
    pred = [draw(st.lists(st.sampled_from(alphabet), min_size=n, max_size=n)) for n in lengths]
    return gold, pred


@settings(max_examples=300, deadline=None)
@given(corpora=tag_corpora(BIO_TAGS))
@example(corpora=([["I-A", "I-A", "O", "B-B", "I-A"], ["O"]], [["B-A", "I-A", "O", "I-B", "B-A"], ["I-B"]]))
def test_strict_scores_match_seqeval(corpora):
    gold, pred = corpora
    ours = entity_scores([tags_to_spans(g) for g in gold], [tags_to_spans(p) for p in pred])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seqeval warns when a denominator is 0 (and then returns 0.0)
        theirs = {
            "strict_precision": precision_score(gold, pred),
            "strict_recall": recall_score(gold, pred),
            "strict_f1": f1_score(gold, pred),
        }
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(float(value), abs=1e-12, rel=0), key


@settings(max_examples=300, deadline=None)
@given(tags=st.lists(st.sampled_from(BIOES_TAGS), max_size=20), scheme=st.sampled_from(SCHEMES))
def test_chunking_matches_seqeval_get_entities(tags, scheme):
    """Entity by entity, for BIO and BIOES sequences (seqeval ends are inclusive, ours exclusive)."""
    if scheme == "BIO":
        tags = [t for t in tags if t[0] in "OBI"]
    ours = [(t, s, e - 1) for t, s, e in tags_to_spans(tags, scheme)]
    assert ours == get_entities(list(tags))
