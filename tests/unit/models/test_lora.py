"""LoRA adapters (fedclinic.models.lora): the adapted model starts as the base model, only adapters and head train,
merging computes the same function, export merges, and every malformed package or spec is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedclinic.models import lora
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import build_model, module_tensors, package_from_config
from fedclinic.transport.package import META_FILE, ModelPackage
from fedclinic.training.trainer import TrainConfig, encode, select_tensors, train_local

from tests.helpers.symptom_models import LABELS, TINY_BERT, TOK, examples


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def base_package() -> ModelPackage:
    return package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=TOK, config=TINY_BERT,
                               max_length=32, seed=1)


def logits(pkg_or_loaded, data) -> np.ndarray:
    loaded = build_model(pkg_or_loaded) if isinstance(pkg_or_loaded, ModelPackage) else pkg_or_loaded
    loaded.module.eval()
    ids, mask = data.batch(np.arange(len(data)), torch.device("cpu"))[0]
    with torch.no_grad():
        return loaded.logits(ids, mask).numpy()


def test_adapters_start_at_zero_effect_and_are_named_after_their_linear():
    base = base_package()
    adapted = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8))
    names = sorted(n for n in adapted.tensors if lora.is_adapter(n))
    assert names == sorted(f"bert.encoder.layer.{i}.attention.self.{w}.lora_{ab}"
                           for i in range(2) for w in ("query", "value") for ab in "AB")
    assert adapted.tensors["bert.encoder.layer.0.attention.self.query.lora_A"].shape == (4, 32)
    assert not adapted.tensors["bert.encoder.layer.0.attention.self.query.lora_B"].any()
    assert set(base.tensors) < set(adapted.tensors) and adapted.meta["lora"]["rank"] == 4
    loaded = build_model(adapted)
    assert set(adapted.tensors) == set(loaded.module.state_dict())  # the package names are the module's names
    data = encode(examples(6), loaded, max_length=32)
    np.testing.assert_array_equal(logits(loaded, data), logits(base, data))
    # the same spec and seed give the same adapters: every site and the aggregator agree on round 0
    again = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8))
    for n in names:
        np.testing.assert_array_equal(again.tensors[n], adapted.tensors[n])


def test_only_adapters_and_head_train_and_the_merged_model_computes_the_same_function():
    adapted = lora.add_adapters(base_package(), lora.LoraSpec(rank=4, alpha=8, seed=3))
    loaded = build_model(adapted)
    data = encode(examples(24), loaded, max_length=32)
    names = select_tensors(list(adapted.tensors), lora.trainable_patterns())
    assert names and all(lora.is_adapter(n) or n.startswith("classifier.") for n in names)
    train_local(loaded, data, TrainConfig(local_epochs=3, batch_size=8, learning_rate=5e-2, seed=0),
                trainable=names)
    trained = ModelPackage(tensors={**adapted.tensors, **module_tensors(loaded.module, names)},
                           files=adapted.files)
    assert trained.tensors["bert.encoder.layer.1.attention.self.value.lora_B"].any()  # the adapters moved
    for n in adapted.tensors:
        if n not in names:  # base weights untouched
            np.testing.assert_array_equal(trained.tensors[n], adapted.tensors[n])
    merged = lora.merge(trained)
    assert set(merged.tensors) == set(base_package().tensors) and "lora" not in merged.meta
    want = logits(trained, data)
    np.testing.assert_allclose(logits(merged, data), want, atol=1e-5)
    assert lora.merge(merged) is merged  # nothing left to merge


def test_export_merges_the_adapters_and_matches_the_adapted_model(tmp_path):
    import onnxruntime as ort

    from fedclinic.export.onnx_export import export_onnx

    adapted = lora.add_adapters(base_package(), lora.LoraSpec(rank=2, alpha=4))
    adapted.tensors["bert.encoder.layer.0.attention.self.query.lora_B"][:] = 0.5  # a non-zero update
    adapted.save(tmp_path / "pkg")
    messages: list[str] = []
    report = export_onnx(tmp_path / "pkg", tmp_path / "out", log=messages.append)
    assert report.fp32.max_abs_diff <= 1e-4 and any("LoRA adapters merged" in m for m in messages)
    assert "lora" not in json.loads((tmp_path / "out" / META_FILE).read_text())
    loaded = build_model(adapted)
    data = encode(examples(5), loaded, max_length=32)
    ids, mask = data.batch(np.arange(5), torch.device("cpu"))[0]
    session = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    np.testing.assert_allclose(got, logits(loaded, data), atol=1e-4)  # the unmerged, adapted model's output


def test_bad_specs_and_packages_are_refused_with_the_reason():
    base = base_package()
    with pytest.raises(ConfigError, match="rank must be an integer >= 1"):
        lora.add_adapters(base, lora.LoraSpec(rank=0))
    with pytest.raises(ConfigError, match="alpha must be a finite number > 0"):
        lora.add_adapters(base, lora.LoraSpec(alpha=float("nan")))
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        lora.add_adapters(base, lora.LoraSpec(targets=("(",)))
    with pytest.raises(ConfigError, match=r"no linear layer matches .* linear layers of this model include"):
        lora.add_adapters(base, lora.LoraSpec(targets=(r".*\.nothing",)))
    adapted = lora.add_adapters(base, lora.LoraSpec(rank=2))
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        lora.add_adapters(adapted, lora.LoraSpec(rank=2))

    missing = ModelPackage(tensors={n: t for n, t in adapted.tensors.items() if not n.endswith("query.lora_B")},
                           files=adapted.files)
    with pytest.raises(IntegrityError, match=r"query.lora_B is missing"):
        build_model(missing)
    reshaped = dict(adapted.tensors)
    reshaped["bert.encoder.layer.0.attention.self.value.lora_A"] = np.zeros((3, 32), np.float32)
    with pytest.raises(IntegrityError, match=r"has shape \(3, 32\), expected \(2, 32\)"):
        build_model(ModelPackage(tensors=reshaped, files=adapted.files))
    stray = {**adapted.tensors, "classifier.lora_A": np.zeros((2, 32), np.float32)}
    with pytest.raises(IntegrityError, match="belong to no target linear"):
        build_model(ModelPackage(tensors=stray, files=adapted.files))
    meta = {**adapted.meta, "lora": {"rank": 2, "alpha": 4, "targets": ["x"], "dropout": 0.1}}
    files = {**adapted.files, META_FILE: json.dumps(meta).encode()}
    with pytest.raises(IntegrityError, match=r"unknown keys \['dropout'\]"):
        build_model(ModelPackage(tensors=adapted.tensors, files=files))


def test_dp_sgd_trains_only_the_adapters_and_head():
    """DP-SGD over adapters (exactness: tests/unit/privacy/test_dp_sgd_lora.py) changes the trained tensors only."""
    from fedclinic.privacy.dp_sgd import DPSGD, train_local_private

    adapted = lora.add_adapters(base_package(), lora.LoraSpec(rank=2))
    loaded = build_model(adapted)
    data = encode(examples(8), loaded, max_length=32)
    names = select_tensors(list(adapted.tensors), lora.trainable_patterns())
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    train_local_private(loaded, data, TrainConfig(batch_size=4),
                        DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, steps=2), trainable=names)
    changed = {n for n, p in loaded.module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == set(names)


def test_a_federated_lora_task_trains_and_aggregates_only_adapters_and_head():
    from fedclinic.federation.simulate import simulate

    start = lora.add_adapters(base_package(), lora.LoraSpec(rank=4, alpha=8))
    sites = [examples(30, seed=s) for s in range(3)]
    res = simulate(start, sites, rounds=3, eval_data=examples(60, seed=99),
                   trainable_patterns=lora.trainable_patterns(),
                   train=TrainConfig(learning_rate=2e-2, batch_size=8, max_length=32, local_epochs=2))
    assert res.trainable and all(lora.is_adapter(n) or n.startswith("classifier.") for n in res.trainable)
    for name, arr in start.tensors.items():  # base weights bit-identical, adapters and head moved
        assert np.array_equal(arr, res.package.tensors[name]) == (name not in res.trainable)
    sent = sum(start.tensors[n].size for n in res.trainable)
    assert sent < 0.2 * sum(t.size for t in start.tensors.values())
    assert res.rounds[-1].metrics["loss"] < res.initial_metrics["loss"]
    merged = lora.merge(res.package)
    data = encode(examples(6, seed=5), build_model(merged), max_length=32)
    np.testing.assert_allclose(logits(merged, data), logits(res.package, data), atol=1e-5)
