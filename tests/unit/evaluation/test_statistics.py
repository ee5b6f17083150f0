"""Federated statistics on real tokenizers: the keys, tokenizer coverage on a script the tokenizer does not cover,
missing and invalid rows from the tolerant reader, small-cell and complementary suppression, and pooling."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest

from fedclinic.data.text import Example, read_classification
from fedclinic.errors import DatasetError
from fedclinic.evaluation.statistics import RowProblems, pool_statistics, site_statistics, suppress_site
from fedclinic.evaluation.statistics_counts import label_keys, unk_rate
from fedclinic.models.base import load_tokenizer, wordlevel_tokenizer_json
from fedclinic.proto import task_pb2

K = 10
ENGLISH = ["the patient reports mild fever", "severe cough and chills", "rash with itch", "nausea"]
THAI = ["ผู้ป่วยมีไข้สูงและไอ", "ปวดศีรษะรุนแรง", "คลื่นไส้อาเจียน"]
DEVANAGARI = ["रोगी को तेज बुखार है", "खांसी और ठंड लगना"]


@pytest.fixture(scope="module")
def minilm():
    from fedclinic.assets import minilm_path

    return load_tokenizer((minilm_path() / "tokenizer.json").read_bytes())


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(wordlevel_tokenizer_json(" ".join(ENGLISH).split()))


def spec(labels=("a", "b", "c"), multi_label=False, max_length=16) -> task_pb2.TaskSpec:
    return task_pb2.TaskSpec(family="text-classification", labels=list(labels), multi_label=multi_label,
                             training=task_pb2.TrainingConfig(max_length=max_length))


def rows(texts, labels, n):
    return [Example(texts[i % len(texts)], (labels[i % len(labels)],)) for i in range(n)]


def test_a_script_the_tokenizer_does_not_cover_has_a_high_unk_rate(minilm, tiny):
    thai = site_statistics(rows(THAI, "ab", 30), minilm, spec(), min_cell=K)
    english = site_statistics(rows(ENGLISH, "ab", 30), minilm, spec(), min_cell=K)
    assert thai["unk_rate"] > 0.5 and english["unk_rate"] < 0.05
    hindi = site_statistics(rows(DEVANAGARI, "ab", 30), tiny, spec(), min_cell=K)
    assert hindi["unk_rate"] > 0.5
    assert site_statistics(rows(ENGLISH, "ab", 30), tiny, spec(), min_cell=K)["unk_rate"] == 0.0
    assert unk_rate(minilm, THAI) > 0.5 and unk_rate(minilm, []) == 0.0
    # tokens per character: Thai words become one [UNK] each, far fewer tokens than characters
    assert thai["tokens_per_char"] < english["tokens_per_char"]


def test_keys_counts_quantiles_and_truncation_are_exact(minilm):
    texts = [("word " * n).strip() for n in range(1, 41)]  # 1..40 words
    examples = [Example(t, ("a" if i % 4 else "b",)) for i, t in enumerate(texts)]
    v = site_statistics(examples, minilm, spec(max_length=16), min_cell=K)
    assert v["rows"] == 40 and v["label/a"] == 30 and v["label/b"] == 10 and v["label/c"] == 0
    assert v["missing_rows"] == 0 and v["invalid_rows"] == 0
    chars = np.array([len(t) for t in texts])
    tokens = np.array([len(minilm.encode(t).ids) for t in texts])  # with [CLS] and [SEP]
    for pp in (5, 25, 50, 75, 95):
        assert v[f"chars_q{pp:02d}"] == pytest.approx(np.percentile(chars, pp))
        assert v[f"tokens_q{pp:02d}"] == pytest.approx(np.percentile(tokens, pp))
    assert v["count/truncated_rows"] == (tokens > 16).sum() == 26
    assert v["truncated_rate"] == pytest.approx(26 / 40)
    assert v["count/tokens"] == (tokens - 2).sum() and v["count/chars"] == chars.sum()
    assert v["tokens_per_char"] == pytest.approx((tokens - 2).sum() / chars.sum())
    assert not any(key.startswith("suppressed/") for key in v)
    assert all(len(key) <= 200 and key.isascii() for key in v)
    # without a tokenizer the token keys are absent, the rest the same
    plain = site_statistics(examples, None, spec(max_length=16), min_cell=K)
    assert "unk_rate" not in plain and "tokens_q50" not in plain and plain["chars_q50"] == v["chars_q50"]


def test_missing_and_invalid_rows_come_from_the_tolerant_reader(tmp_path, minilm):
    good = [{"text": f"patient {i} has fever", "label": "a"} for i in range(12)]
    lines = [json.dumps(r) for r in good] + [
        '{"text": "", "label": "a"}', '{"text": "cough"}', '{"text": "  ", "label": "b"}',  # 3 missing
        "{not json", "[1, 2]", '{"text": "rash", "label": "zzz"}', '{"text": 5, "label": "a"}',
        '{"text": "itch", "label": ["a", "b"]}',                                              # 5 invalid
    ] + [json.dumps({"text": "x", "label": "b"})] * 10
    path = tmp_path / "notes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems = RowProblems()
    examples = read_classification(path, label_set=["a", "b", "c"], on_bad_row=problems)
    assert (problems.missing, problems.invalid, len(examples)) == (3, 5, 22)
    # hand-built examples are classified again: an unknown label, an empty text
    extra = [Example("fine", ("zzz",)), Example(" ", ("a",))]
    v = site_statistics(examples + extra, minilm, spec(), min_cell=3, problems=problems)
    assert (v["rows"], v["missing_rows"], v["invalid_rows"]) == (22, 4, 6)
    with pytest.raises(DatasetError, match="row 13: empty text"):  # the strict reader is unchanged
        read_classification(path, label_set=["a", "b", "c"])
    csv = tmp_path / "notes.csv"
    csv.write_text("text,label\nfever,a\n,a\ncough,q\nrash,b\n")
    problems = RowProblems()
    assert len(read_classification(csv, label_set=["a", "b"], on_bad_row=problems)) == 2
    assert (problems.missing, problems.invalid) == (1, 1)


def test_a_site_under_k_rows_withholds_everything_about_its_rows(minilm):
    v = site_statistics(rows(ENGLISH, "ab", K - 1), minilm, spec(), min_cell=K)
    assert set(v) == {"missing_rows", "invalid_rows", "min_cell_rows"} | {k for k in v if k.startswith("suppressed/")}
    for key in ("rows", "label/a", "chars_q50", "tokens_q95", "unk_rate", "truncated_rate", "count/tokens"):
        assert key not in v and v[f"suppressed/{key}"] == 1
    assert site_statistics(rows(ENGLISH, "ab", K), minilm, spec(), min_cell=K)["rows"] == K


def test_a_small_label_is_withheld_with_a_complement_so_rows_minus_the_rest_reveals_nothing(minilm):
    examples = rows(ENGLISH, "a", 50) + rows(ENGLISH, "b", 3) + rows(ENGLISH, "c", 20)
    v = site_statistics(examples, minilm, spec(), min_cell=K)
    assert v["rows"] == 73 and v["label/a"] == 50
    assert "label/b" not in v and v["suppressed/label/b"] == 1
    assert "label/c" not in v and v["suppressed/label/c"] == 1  # the complement: the smallest other cell
    # without the complementary rule rows - label/a - label/c would give label/b = 3
    assert v["rows"] - v["label/a"] == 23
    # a label a site lacks is published as 0, not withheld
    v = site_statistics(rows(ENGLISH, "ab", 40), minilm, spec(), min_cell=K)
    assert v["label/c"] == 0 and "suppressed/label/c" not in v


def test_complementary_suppression_invariant_on_random_tables():
    rng = random.Random(5)
    for _ in range(2000):
        labels = [f"l{i}" for i in range(rng.randint(2, 6))]
        multi = rng.random() < 0.5
        keys = label_keys(labels, multi)
        cells = {key: float(rng.choice([0, 0, 1, 2, 5, 9, 10, 11, 30, 200])) for key in keys}
        total = sum(cells[k] for k in keys[:len(labels)])
        values = {"rows": max(total, K), **cells}
        out = suppress_site(values, labels=labels, multi_label=multi, min_cell=K)
        hidden = [k for k in keys if f"suppressed/{k}" in out]
        assert all(k not in out for k in hidden)
        assert all(out[k] == 0 or out[k] >= K for k in keys if k in out)  # no small cell is published
        if hidden:  # never one withheld cell, and the withheld ones hold >= k rows together (or all are withheld)
            assert len(hidden) >= 2 or len(keys) == 1
            assert sum(cells[k] for k in hidden) >= K or len(hidden) == len(keys)


def test_multi_label_co_occurrence_and_its_suppression(minilm):
    examples = ([Example("fever", ("a", "b"))] * 15 + [Example("cough", ("a",))] * 20
                + [Example("rash", ("b", "c"))] * 4 + [Example("itch", ("c",))] * 30)
    v = site_statistics(examples, minilm, spec(multi_label=True), min_cell=K)
    assert v["rows"] == 69 and v["label/a"] == 35 and v["label/b"] == 19 and v["label/c"] == 34
    assert v["label_pair/a|c"] == 0  # labels never seen together: published
    assert "label_pair/b|c" not in v and v["suppressed/label_pair/b|c"] == 1
    # its complement, the smallest non-zero cell (a|b, 15): else rows = a + b + c - ab - bc (no row has three
    # labels here) would give bc = 35 + 19 + 34 - 15 - 69 = 4
    assert "label_pair/a|b" not in v and v["suppressed/label_pair/a|b"] == 1
    exact = {"rows": 69.0, "label/a": 35.0, "label/b": 19.0, "label/c": 34.0, "label_pair/a|b": 15.0,
             "label_pair/a|c": 0.0, "label_pair/b|c": 4.0}
    assert suppress_site(exact, labels="abc", multi_label=True, min_cell=3) == exact  # k = 3: nothing small


def test_a_label_name_that_is_not_printable_ascii_uses_its_index(minilm):
    s = spec(labels=("fièvre", "toux"))
    v = site_statistics([Example("a", ("fièvre",))] * 12 + [Example("b", ("toux",))] * 12, minilm, s, min_cell=K)
    assert v["label/#0"] == 12 and v["label/toux"] == 12
    assert label_keys(["x" * 300, "y"], True) == ["label/#0", "label/y", "label_pair/#0|#1"]
    assert label_keys(["a|b", "c"], True) == ["label/a|b", "label/c", "label_pair/#0|#1"]


def test_pooling_sums_what_sites_published_and_marks_what_they_withheld(minilm):
    a = site_statistics(rows(ENGLISH, "a", 50) + rows(ENGLISH, "b", 3) + rows(ENGLISH, "c", 20), minilm, spec(),
                        min_cell=K)
    b = site_statistics(rows(THAI, "abc", 60), minilm, spec(), min_cell=K)
    tiny = site_statistics(rows(ENGLISH, "a", 4), minilm, spec(), min_cell=K)
    pooled = pool_statistics({"A": a, "B": b, "T": tiny}, min_cell=K)
    assert pooled["sites"] == 2 and pooled["rows"] == 73 + 60 and pooled["partial/rows"] == 1
    assert pooled["label/a"] == 50 + 20 and pooled["partial/label/a"] == 1
    assert pooled["label/b"] == 20 and pooled["partial/label/b"] == 2  # A withheld its b (3), T everything
    # rates from pooled sums: exact over the sites that published both parts
    assert pooled["unk_rate"] == pytest.approx((a["count/unk_tokens"] + b["count/unk_tokens"])
                                               / (a["count/tokens"] + b["count/tokens"]))
    assert pooled["tokens_per_char"] == pytest.approx((a["count/tokens"] + b["count/tokens"])
                                                      / (a["count/chars"] + b["count/chars"]))
    # quantiles: the row-weighted mean of the sites' quantiles
    assert pooled["chars_q50"] == pytest.approx((73 * a["chars_q50"] + 60 * b["chars_q50"]) / 133)
    # a key every site withheld is withheld in the pool
    only = pool_statistics({"T": tiny}, min_cell=K)
    assert "rows" not in only and only["suppressed/rows"] == 1 and only["sites"] == 0


def test_the_pool_reveals_nothing_the_published_values_do_not():
    # two sites whose published values are equal pool to the same values, whatever they withheld
    base = {"rows": 40.0, "label/a": 40.0, "label/b": 0.0}
    hidden_small = {"rows": 40.0, "suppressed/label/a": 1.0, "suppressed/label/b": 1.0}
    p1 = pool_statistics({"x": base, "y": hidden_small}, min_cell=K)
    assert p1["label/a"] == 40 and p1["partial/label/a"] == 1 and p1["rows"] == 80
    for combo in itertools.permutations([base, hidden_small]):
        assert pool_statistics(dict(zip("xy", combo)), min_cell=K) == p1


def test_a_task_object_gives_the_same_answer_as_its_spec(minilm):
    from fedclinic.spec.task import Task

    task = Task(name="s", dataset="notes", labels=["a", "b", "c"], max_length=16)
    examples = rows(ENGLISH, "ab", 30)
    assert site_statistics(examples, minilm, task, min_cell=K) == site_statistics(examples, minilm, spec(),
                                                                                   min_cell=K)


def test_a_multi_label_task_with_many_labels_reports_no_pairs_and_stays_within_the_key_limit():
    labels = [f"finding{i}" for i in range(200)]
    v = site_statistics([Example("x", ("finding0", "finding1"))] * 20, None, spec(labels=labels, multi_label=True),
                        min_cell=K)
    assert v["label/finding0"] == 20 and not any(k.startswith(("label_pair/", "suppressed/label_pair/")) for k in v)
    assert len(v) < 8192
    assert len(label_keys(labels[:90], True)) == 90 + 90 * 89 // 2


def test_truncation_is_withheld_when_the_truncated_or_the_untruncated_rows_are_few():
    base = {"rows": 100.0, "count/truncated_rows": 95.0, "truncated_rate": 0.95}
    out = suppress_site(base, labels=[], multi_label=False, min_cell=K)  # 5 untruncated rows: rows - 95
    assert "truncated_rate" not in out and out["suppressed/count/truncated_rows"] == 1
    base.update({"count/truncated_rows": 50.0, "truncated_rate": 0.5})
    assert suppress_site(base, labels=[], multi_label=False, min_cell=K)["truncated_rate"] == 0.5
