"""fedclinic.models: packaging, strict building, tensor I/O, and the clear errors of each failure."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import (
    ALLOWED_MODEL_TYPES,
    build_model,
    load_tensors,
    load_tokenizer,
    module_tensors,
    package_from_config,
    package_pretrained,
    tokenizer_pad_id,
    wordlevel_tokenizer_json,
)
from fedclinic.transport.package import ModelPackage

from tests.helpers.pretrained import WORDS, pretrained_bert_folder
from tests.helpers.symptom_models import TINY_BERT

LABELS = ["resp", "skin", "gi"]
CONFIGS = {
    "transformer": TINY_BERT,
    "lstm": {"embedding_dim": 8, "hidden_size": 8, "num_layers": 2, "bidirectional": True, "dropout": 0.0},
    "logreg": {},
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok_json() -> bytes:
    return wordlevel_tokenizer_json(WORDS)


def _pkg(tok_json, arch="transformer", seed=0, **kw) -> ModelPackage:
    return package_from_config(architecture=arch, labels=LABELS, tokenizer_json=tok_json, config=CONFIGS[arch],
                               max_length=32, seed=seed, **kw)


def _ids(loaded, texts):
    encs = [loaded.tokenizer.encode(t) for t in texts]
    width = max(len(e.ids) for e in encs)
    ids = torch.full((len(texts), width), loaded.pad_id, dtype=torch.long)
    mask = torch.zeros((len(texts), width), dtype=torch.long)
    for i, e in enumerate(encs):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
    return ids, mask


# --------------------------------------------------------------------------------------------------- tokenizer


def test_wordlevel_tokenizer_layout(tok_json):
    tok = load_tokenizer(tok_json)
    assert tok.token_to_id("[PAD]") == 0 and tok.token_to_id("[UNK]") == 1
    enc = tok.encode("Fever and COUGH")
    assert enc.tokens == ["[CLS]", "fever", "[UNK]", "cough", "[SEP]"]
    assert tokenizer_pad_id(tok_json) == 0
    with pytest.raises(ConfigError, match="no whitespace"):
        wordlevel_tokenizer_json(["two words"])


def test_unparseable_tokenizer_is_integrity_error():
    with pytest.raises(IntegrityError, match="tokenizer.json could not be parsed"):
        load_tokenizer(b"{not json")


# --------------------------------------------------------------------------------------------------- packaging


@pytest.mark.parametrize("arch", ["transformer", "lstm", "logreg"])
def test_package_from_config_layout_and_roundtrip(tok_json, arch, tmp_path):
    pkg = _pkg(tok_json, arch)
    meta = pkg.meta
    assert meta == {"format": 1, "family": "text-classification", "architecture": arch, "labels": LABELS,
                    "multi_label": False, "max_length": 32, "base_model": "from-config",
                    "arch_config": meta["arch_config"]}
    assert pkg.files["tokenizer.json"] == tok_json
    assert ("config.json" in pkg.files) == (arch == "transformer")
    loaded = build_model(pkg)
    # package tensors are exactly the module's state dict, as float32 numpy arrays
    state = loaded.module.state_dict()
    assert set(pkg.tensors) == set(state)
    for name, arr in pkg.tensors.items():
        assert arr.dtype == np.float32 and arr.shape == tuple(state[name].shape)
        np.testing.assert_array_equal(arr, state[name].numpy())
    ids, mask = _ids(loaded, ["fever cough", "rash"])
    assert loaded.logits(ids, mask).shape == (2, 3)
    # saving and loading the folder keeps the package byte-identical
    again = ModelPackage.load(pkg.save(tmp_path / arch))
    assert again.manifest().model_hash == pkg.manifest().model_hash


@pytest.mark.parametrize("arch", ["transformer", "lstm"])
def test_seed_makes_initialisation_deterministic(tok_json, arch):
    a, b, c = _pkg(tok_json, arch, seed=1), _pkg(tok_json, arch, seed=1), _pkg(tok_json, arch, seed=2)
    assert a.manifest().model_hash == b.manifest().model_hash
    assert a.manifest().model_hash != c.manifest().model_hash


def test_seeding_leaves_the_callers_rng_alone(tok_json):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    _pkg(tok_json, "lstm", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_logreg_is_zero_initialised_bag_of_tokens(tok_json):
    pkg = _pkg(tok_json, "logreg")
    assert sorted(pkg.tensors) == ["bias", "token_weights.weight"]
    assert pkg.tensors["token_weights.weight"].shape == (len(WORDS) + 4, 3)
    assert not pkg.tensors["token_weights.weight"].any()
    loaded = build_model(pkg)
    w = np.zeros((len(WORDS) + 4, 3), np.float32)
    tok = loaded.tokenizer
    w[tok.token_to_id("fever"), 0] = 1.0
    load_tensors(loaded.module, {"token_weights.weight": w, "bias": np.array([0.0, 0.5, 0.0], np.float32)})
    ids, mask = _ids(loaded, ["fever fever rash", "rash"])
    out = loaded.logits(ids, mask).detach().numpy()
    np.testing.assert_allclose(out, [[2.0, 0.5, 0.0], [0.0, 0.5, 0.0]])  # counts, padding excluded


@pytest.mark.parametrize("arch", ["transformer", "lstm", "logreg"])
def test_padding_does_not_change_logits(tok_json, arch):
    loaded = build_model(_pkg(tok_json, arch))
    ids, mask = _ids(loaded, ["fever", "the patient reports mild fever and severe cough"])
    alone_ids, alone_mask = _ids(loaded, ["fever"])
    with torch.no_grad():
        batched = loaded.logits(ids, mask)[0]
        alone = loaded.logits(alone_ids, alone_mask)[0]
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)


def test_multi_label_and_hf_config(tok_json):
    pkg = package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=tok_json,
                              config=TINY_BERT, multi_label=True, max_length=32)
    assert pkg.meta["multi_label"] is True
    cfg = json.loads(pkg.files["config.json"])
    assert cfg["problem_type"] == "multi_label_classification"
    assert cfg["id2label"] == {"0": "resp", "1": "skin", "2": "gi"}
    assert cfg["architectures"] == ["BertForSequenceClassification"]
    assert cfg["vocab_size"] == len(WORDS) + 4 and "_name_or_path" not in cfg
    assert build_model(pkg).multi_label


def test_saved_transformer_package_is_a_normal_hf_folder(tok_json, tmp_path):
    from transformers import AutoModelForSequenceClassification

    pkg = _pkg(tok_json)
    folder = pkg.save(tmp_path / "pkg")
    hf = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    ours = build_model(pkg)
    ids, mask = _ids(ours, ["fever cough", "rash itch hives"])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits, ours.logits(ids, mask))


# ------------------------------------------------------------------------------------------ pretrained folders


@pytest.mark.parametrize("variant", [{}, {"prefix": True}, {"legacy_ln": True}])
def test_package_pretrained_loads_encoder_and_seeds_the_head(tmp_path, tok_json, variant):
    folder, encoder = pretrained_bert_folder(tmp_path, tok_json, **variant)
    pkg = package_pretrained(folder, labels=LABELS, max_length=32, seed=3)
    for name, arr in encoder.items():
        np.testing.assert_array_equal(pkg.tensors[f"bert.{name}"], arr)
    assert pkg.tensors["classifier.weight"].shape == (3, 32)
    assert pkg.meta["base_model"] == "pretrained" and pkg.meta["arch_config"] == {"model_type": "bert"}
    assert "tokenizer_config.json" in pkg.files
    same = package_pretrained(folder, labels=LABELS, max_length=32, seed=3)
    other = package_pretrained(folder, labels=LABELS, max_length=32, seed=4)
    assert same.manifest().model_hash == pkg.manifest().model_hash
    assert not np.array_equal(other.tensors["classifier.weight"], pkg.tensors["classifier.weight"])
    build_model(pkg)


@pytest.mark.parametrize("arch", ["lstm", "logreg"])
def test_package_pretrained_non_transformer_takes_only_the_tokenizer(tmp_path, tok_json, arch):
    folder, _ = pretrained_bert_folder(tmp_path, tok_json)
    pkg = package_pretrained(folder, labels=LABELS, architecture=arch,
                             config={"hidden_size": 4, "embedding_dim": 4} if arch == "lstm" else None)
    assert pkg.files["tokenizer.json"] == tok_json and "config.json" not in pkg.files
    assert not any(k.startswith("bert.") for k in pkg.tensors)
    assert pkg.meta["arch_config"]["vocab_size"] == len(WORDS) + 4


def test_package_pretrained_replaces_an_existing_head_and_reads_shards(tmp_path, tok_json):
    from safetensors.numpy import load_file, save_file

    folder, encoder = pretrained_bert_folder(tmp_path, tok_json, prefix=True)
    weights = load_file(str(folder / "model.safetensors"))
    weights["classifier.weight"] = np.ones((7, 32), np.float32)  # a head fine-tuned for 7 other labels
    weights["classifier.bias"] = np.ones(7, np.float32)
    names = sorted(weights)
    half = len(names) // 2
    save_file({k: weights[k] for k in names[:half]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: weights[k] for k in names[half:]}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                                            for i, k in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    pkg = package_pretrained(folder, labels=LABELS, max_length=32)
    assert pkg.tensors["classifier.weight"].shape == (3, 32)
    np.testing.assert_array_equal(pkg.tensors["bert.pooler.dense.weight"], encoder["pooler.dense.weight"])


def test_package_pretrained_errors(tmp_path, tok_json):
    with pytest.raises(ConfigError, match="does not exist"):
        package_pretrained(tmp_path / "nope", labels=LABELS)
    folder, _ = pretrained_bert_folder(tmp_path, tok_json, drop="encoder.layer.1.output.dense.weight")
    with pytest.raises(IntegrityError, match=r"lack encoder tensor\(s\) 'bert\.encoder\.layer\.1\.output\.dense\.weight'"):
        package_pretrained(folder, labels=LABELS, max_length=32)


def test_package_pretrained_refuses_pickle_weights(tmp_path, tok_json):
    folder, _ = pretrained_bert_folder(tmp_path, tok_json, bin_only=True)
    with pytest.raises(ConfigError, match="only safetensors weights are loaded"):
        package_pretrained(folder, labels=LABELS, max_length=32)


def test_package_pretrained_needs_tokenizer_json(tmp_path, tok_json):
    folder, _ = pretrained_bert_folder(tmp_path, tok_json)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        package_pretrained(folder, labels=LABELS)


def test_package_pretrained_refuses_model_types_outside_the_allowlist(tmp_path, tok_json):
    folder, _ = pretrained_bert_folder(tmp_path, tok_json)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["auto_map"] = {"AutoModel": "evil.Model"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not allowed.*bert, roberta, distilbert, electra"):
        package_pretrained(folder, labels=LABELS, max_length=32)


# ------------------------------------------------------------------------------------------ config validation


def test_package_from_config_validation(tok_json):
    def make(**kw):
        args = dict(architecture="lstm", labels=LABELS, tokenizer_json=tok_json, config={})
        args.update(kw)
        return package_from_config(**args)

    with pytest.raises(ConfigError, match="unknown architecture 'cnn'.*transformer, lstm, logreg"):
        make(architecture="cnn")
    with pytest.raises(ConfigError, match=r"labels must be unique; repeated: \['a'\]"):
        make(labels=["a", "a", "b"])
    with pytest.raises(ConfigError, match="needs at least 2 labels"):
        make(labels=["a"])
    make(labels=["a"], multi_label=True)  # one label is fine when multi-label
    with pytest.raises(ConfigError, match="unknown lstm config key"):
        make(config={"hidden": 3})
    with pytest.raises(ConfigError, match="hidden_size must be a positive integer"):
        make(config={"hidden_size": 0})
    with pytest.raises(ConfigError, match="logreg takes no config keys"):
        make(architecture="logreg", config={"hidden_size": 3})
    with pytest.raises(ConfigError, match="max_length must be an integer >= 2"):
        make(max_length=1)
    with pytest.raises(ConfigError, match="model_type 'xlnet' is not allowed"):
        make(architecture="transformer", config={"model_type": "xlnet"})
    with pytest.raises(ConfigError, match="max_length 128 exceeds what the model supports \\(64 positions\\)"):
        make(architecture="transformer", config=TINY_BERT, max_length=128)
    with pytest.raises(ConfigError, match="the tokenizer has 17 tokens but the model's vocab_size is 5"):
        make(architecture="transformer", config={**TINY_BERT, "vocab_size": 5})


def test_allowlist_is_the_documented_one():
    assert ALLOWED_MODEL_TYPES == ("bert", "roberta", "distilbert", "electra")


@pytest.mark.parametrize("model_type,extra", [
    ("roberta", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
                 "max_position_embeddings": 40}),
    ("distilbert", {"dim": 32, "n_layers": 1, "n_heads": 2, "hidden_dim": 32, "max_position_embeddings": 40}),
    ("electra", {"embedding_size": 16, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "intermediate_size": 32, "max_position_embeddings": 40}),
])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_other_allowed_encoders_build(tok_json, model_type, extra, pooling):
    pkg = package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=tok_json,
                              config={"model_type": model_type, **extra, "pooling": pooling}, max_length=16)
    loaded = build_model(pkg)
    ids, mask = _ids(loaded, ["fever cough", "rash"])
    assert loaded.logits(ids, mask).shape == (2, 3)
    if pooling == "mean":  # no pooler tensor, whatever the base class calls it
        assert not [n for n in pkg.tensors if "pooler" in n] and "classifier.weight" in pkg.tensors


# --------------------------------------------------------------------------------------------- build errors


def _with_meta(pkg: ModelPackage, **changes) -> ModelPackage:
    meta = {**pkg.meta, **changes}
    return ModelPackage(tensors=dict(pkg.tensors),
                        files={**pkg.files, "fedclinic_model.json": json.dumps(meta).encode()})


def test_build_strict_missing_unexpected_and_shape(tok_json):
    pkg = _pkg(tok_json, "lstm")
    missing = ModelPackage(tensors={k: v for k, v in pkg.tensors.items() if k != "classifier.bias"}, files=pkg.files)
    with pytest.raises(IntegrityError, match=r"missing tensor\(s\) 'classifier.bias'"):
        build_model(missing)
    extra = ModelPackage(tensors={**pkg.tensors, "head.extra": np.zeros(2, np.float32)}, files=pkg.files)
    with pytest.raises(IntegrityError, match=r"unexpected tensor\(s\) 'head.extra'"):
        build_model(extra)
    bad = ModelPackage(tensors={**pkg.tensors, "classifier.bias": np.zeros(5, np.float32)}, files=pkg.files)
    with pytest.raises(IntegrityError, match=r"shape mismatch: classifier.bias \(5,\) != model \(3,\)"):
        build_model(bad)


def test_build_unknown_family_architecture_model_type(tok_json):
    pkg = _pkg(tok_json, "transformer")
    with pytest.raises(ConfigError, match="unknown model family 'image'; supported families: feature-classification, image-text-classification, question-answering, text-classification"):
        build_model(_with_meta(pkg, family="image"))
    with pytest.raises(ConfigError, match="unknown architecture 'gru'.*choose one of: transformer, lstm, logreg"):
        build_model(_with_meta(pkg, architecture="gru"))
    with pytest.raises(ConfigError, match="format 2 is not supported"):
        build_model(_with_meta(pkg, format=2))
    cfg = json.loads(pkg.files["config.json"])
    cfg["model_type"] = "llama"
    evil = ModelPackage(tensors=pkg.tensors, files={**pkg.files, "config.json": json.dumps(cfg).encode()})
    with pytest.raises(ConfigError, match="model_type 'llama' is not allowed.*allowed: bert, roberta"):
        build_model(evil)


def test_build_without_meta_or_tokenizer(tok_json):
    pkg = _pkg(tok_json, "logreg")
    with pytest.raises(IntegrityError, match="has no fedclinic_model.json"):
        build_model(ModelPackage(tensors=pkg.tensors, files={"tokenizer.json": tok_json}))
    with pytest.raises(IntegrityError, match="has no tokenizer.json"):
        build_model(ModelPackage(tensors=pkg.tensors, files={"fedclinic_model.json": pkg.files["fedclinic_model.json"]}))
    other_tok = wordlevel_tokenizer_json(WORDS + ["extra"])
    with pytest.raises(IntegrityError, match="declares vocab_size 17 but tokenizer.json has 18 tokens"):
        build_model(ModelPackage(tensors=pkg.tensors, files={**pkg.files, "tokenizer.json": other_tok}))


# --------------------------------------------------------------------------------------------- tensor I/O


def test_module_tensors_and_load_tensors(tok_json):
    loaded = build_model(_pkg(tok_json, "lstm"))
    got = module_tensors(loaded.module, ["classifier.bias"])
    assert list(got) == ["classifier.bias"] and got["classifier.bias"].dtype == np.float32
    got["classifier.bias"][:] = 42.0  # a copy, not a view of the parameter
    assert not torch.any(loaded.module.classifier.bias == 42.0)
    before = module_tensors(loaded.module)
    load_tensors(loaded.module, {"classifier.bias": np.array([1.0, 2.0, 3.0], np.float32)})
    after = module_tensors(loaded.module)
    np.testing.assert_array_equal(after["classifier.bias"], [1.0, 2.0, 3.0])
    assert all(np.array_equal(before[k], after[k]) for k in before if k != "classifier.bias")
    with pytest.raises(IntegrityError, match=r"unknown tensor\(s\) 'nope'"):
        load_tensors(loaded.module, {"nope": np.zeros(1, np.float32)})
    with pytest.raises(IntegrityError, match=r"classifier.bias \(2,\) != model \(3,\)"):
        load_tensors(loaded.module, {"classifier.bias": np.zeros(2, np.float32)})
    np.testing.assert_array_equal(module_tensors(loaded.module)["classifier.bias"], [1.0, 2.0, 3.0])
    with pytest.raises(IntegrityError, match=r"no tensor\(s\) 'nope'"):
        module_tensors(loaded.module, ["nope"])


def test_encoding_without_offsets_gives_the_ids_and_truncation_of_the_full_encoding():
    """encode_texts skips character offsets (encode_batch_fast); the ids must be those of the tokenizer's full
    encoding, truncated the same way, on the real MiniLM tokenizer and long reviews."""
    from fedclinic.assets.drugreview import load_drug_reviews, minilm_path
    from fedclinic.models.text_classification import encode_texts, load_tokenizer, tokenize_truncated

    raw = (minilm_path() / "tokenizer.json").read_bytes()
    texts = [r["review"] for r in load_drug_reviews()[:40]] + ["", "a"]
    tok = load_tokenizer(raw)
    full = tokenize_truncated(tok, texts, max_length=64)
    ids, mask = encode_texts(tok, texts, max_length=64, pad_id=0)
    assert any(len(e.ids) == 64 for e in full)  # truncation is exercised
    for row, e in zip(range(len(texts)), full):
        assert ids[row, :len(e.ids)].tolist() == e.ids and mask[row].sum() == len(e.ids)
