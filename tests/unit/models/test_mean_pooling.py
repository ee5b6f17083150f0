"""Mean pooling for transformer classifiers (fedclinic.models.mean_pooling): the math, the package layout, the
errors, and that export, SAFL and LoRA take the mean-pooled form like the [CLS] one."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from fedclinic.models import lora
from fedclinic.training import safl
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import build_model, package_from_config, package_pretrained, wordlevel_tokenizer_json
from fedclinic.models.mean_pooling import sentence_transformers_pooling
from fedclinic.transport.package import META_FILE, ModelPackage
from tests.helpers.pretrained import WORDS, declare_pooling, pretrained_bert_folder
from tests.helpers.symptom_models import TINY_BERT

LABELS = ["resp", "skin", "gi"]
MEAN_BERT = {**TINY_BERT, "pooling": "mean", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok_json() -> bytes:
    return wordlevel_tokenizer_json(WORDS)


def _pkg(tok_json, config=MEAN_BERT, seed=0) -> ModelPackage:
    return package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=tok_json, config=config,
                               max_length=32, seed=seed)


def _batch():
    ids = torch.tensor([[2, 5, 7, 9, 0, 0], [3, 4, 0, 0, 0, 0], [6, 8, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    return ids, mask


def test_logits_are_the_head_applied_to_the_masked_mean_of_the_last_layer(tok_json):
    loaded = build_model(_pkg(tok_json))
    ids, mask = _batch()
    with torch.no_grad():
        got = loaded.logits(ids, mask)
        hidden = loaded.module.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        want = torch.stack([hidden[i, mask[i].bool()].mean(dim=0) for i in range(len(ids))])
        want = want @ loaded.module.classifier.weight.T + loaded.module.classifier.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_padding_and_the_additive_4d_mask_do_not_change_the_logits(tok_json):
    """More padding columns, or the export's additive mask (1 - m) * -10000 instead of m, give the same logits."""
    loaded = build_model(_pkg(tok_json))
    ids, mask = _batch()
    with torch.no_grad():
        base = loaded.logits(ids, mask)
        padded = loaded.logits(torch.nn.functional.pad(ids, (0, 5)), torch.nn.functional.pad(mask, (0, 5)))
        additive = (1.0 - mask[:, None, None, :].float()) * -10000.0
        four_d = loaded.module(input_ids=ids, attention_mask=additive).logits
    torch.testing.assert_close(padded, base, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(four_d, base, rtol=1e-5, atol=1e-6)


def test_package_has_no_pooler_records_the_pooling_and_round_trips(tok_json, tmp_path):
    pkg = _pkg(tok_json)
    assert not [n for n in pkg.tensors if ".pooler." in n]
    assert {"classifier.weight", "classifier.bias"} <= set(pkg.tensors)
    assert pkg.meta["arch_config"] == {"model_type": "bert", "pooling": "mean"}
    assert json.loads(pkg.files["config.json"])["architectures"] == ["BertModel"]
    assert "pooling" not in json.loads(pkg.files["config.json"])
    saved = ModelPackage.load(pkg.save(tmp_path / "pkg"))
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(build_model(saved).logits(ids, mask), build_model(pkg).logits(ids, mask))
    assert _pkg(tok_json).manifest().model_hash == pkg.manifest().model_hash
    cls = _pkg(tok_json, TINY_BERT)
    assert cls.meta["arch_config"] == {"model_type": "bert"}  # the [CLS] form is recorded as before
    assert "bert.pooler.dense.weight" in cls.tensors


def test_unknown_pooling_is_refused_when_packaging_and_when_building(tok_json):
    with pytest.raises(ConfigError, match=r"pooling must be one of \['cls', 'mean'\], got 'max'"):
        _pkg(tok_json, {**TINY_BERT, "pooling": "max"})
    pkg = _pkg(tok_json)
    meta = {**pkg.meta, "arch_config": {"model_type": "bert", "pooling": "max"}}
    bad = ModelPackage(tensors=pkg.tensors, files={**pkg.files, META_FILE: json.dumps(meta).encode()})
    with pytest.raises(IntegrityError, match=r"declares pooling 'max'; this version knows \['cls', 'mean'\]"):
        build_model(bad)
    # a mean-pooled package's tensors do not fit the [CLS] form: strict loading names the pooler
    cls_meta = {**pkg.meta, "arch_config": {"model_type": "bert"}}
    mismatch = ModelPackage(tensors=pkg.tensors, files={**pkg.files, META_FILE: json.dumps(cls_meta).encode()})
    with pytest.raises(IntegrityError, match=r"missing tensor\(s\) .*bert\.pooler\.dense"):
        build_model(mismatch)


def test_package_pretrained_takes_the_encoder_and_leaves_the_checkpoints_pooler(tmp_path, tok_json):
    folder, encoder = pretrained_bert_folder(tmp_path, tok_json)
    pkg = package_pretrained(folder, labels=LABELS, max_length=32, seed=3, config={"pooling": "mean"})
    for name, arr in encoder.items():
        if name.startswith("pooler."):
            assert f"bert.{name}" not in pkg.tensors
        else:
            np.testing.assert_array_equal(pkg.tensors[f"bert.{name}"], arr)
    assert pkg.meta["arch_config"] == {"model_type": "bert", "pooling": "mean"}
    build_model(pkg)


def test_a_folder_declaring_mean_pooling_is_named_in_the_log_but_the_default_stays(tmp_path, tok_json, caplog):
    folder, _ = pretrained_bert_folder(tmp_path, tok_json)
    assert sentence_transformers_pooling(folder) is None
    declare_pooling(folder, mean_tokens=True)
    assert sentence_transformers_pooling(folder) == "mean"
    with caplog.at_level(logging.INFO, logger="fedclinic.models"):
        pkg = package_pretrained(folder, labels=LABELS, max_length=32)
    assert pkg.meta["arch_config"] == {"model_type": "bert"}
    assert "was trained with mean pooling (its sentence-transformers config) but the task uses cls pooling" in caplog.text
    assert 'set [model_config] pooling = "mean"' in caplog.text
    declare_pooling(folder, cls_token=True)
    assert sentence_transformers_pooling(folder) == "cls"
    declare_pooling(folder, mean_tokens=True, max_tokens=True)
    assert sentence_transformers_pooling(folder) is None  # a combination this package does not implement
    (folder / "1_Pooling" / "config.json").write_text("{not json")
    assert sentence_transformers_pooling(folder) is None


def test_export_parity_fp32_and_int8_without_the_first_token_rewrite(tok_json, tmp_path):
    from fedclinic.export.onnx_export import export_onnx

    folder = _pkg(tok_json).save(tmp_path / "pkg")
    messages: list[str] = []
    report = export_onnx(folder, tmp_path / "bundle", int8=True, texts=["the patient reports mild fever",
                                                                       "rash", "severe cough and chills itch"],
                         log=messages.append)
    assert report.fp32.max_abs_diff <= 1e-4
    assert report.fused_attention_layers == TINY_BERT["num_hidden_layers"]
    assert report.int8 is not None and report.int8.top1_agreement >= 0.9
    # the mean reads every position of the last layer, so it must not be cut to the first token
    assert any("attention unpacked" in m for m in messages)
    assert not any("first token" in m for m in messages)


def test_safl_profiles_the_mean_pooled_model_and_its_head_is_the_classifier(tok_json):
    from fedclinic.training import trainer as training
    from fedclinic.data.text import Example

    loaded = build_model(_pkg(tok_json))
    rng = np.random.default_rng(0)
    data = training.encode([Example(" ".join(rng.choice(WORDS, 4)), (LABELS[i % 3],)) for i in range(6)],
                           loaded, max_length=16)
    scores = safl.attention_scores(loaded, data, range(6), "cls")
    assert scores.shape == (TINY_BERT["num_hidden_layers"],) and np.all(scores > 0)
    names = list(loaded.module.state_dict())
    chosen = safl.selected_tensors(names, "text-classification", [1])
    assert {n for n in chosen if not n.startswith("bert.encoder.layer.1.")} == {"classifier.weight", "classifier.bias"}


def test_lora_adapters_attach_and_merge_on_the_mean_pooled_model(tok_json):
    pkg = lora.add_adapters(_pkg(tok_json), lora.LoraSpec(rank=2, alpha=4.0, seed=0))
    adapters = [n for n in pkg.tensors if lora.is_adapter(n)]
    assert adapters and all(".pooler." not in n for n in pkg.tensors)
    loaded = build_model(pkg)
    ids, mask = _batch()
    bumped = {n: (a + 0.05 if n.endswith("lora_B") else a) for n, a in pkg.tensors.items()}
    bumped_pkg = ModelPackage(tensors=bumped, files=pkg.files)
    with torch.no_grad():
        want = build_model(bumped_pkg).logits(ids, mask)
        merged = build_model(lora.merge(bumped_pkg)).logits(ids, mask)
        assert not torch.allclose(want, loaded.logits(ids, mask))
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-5)
