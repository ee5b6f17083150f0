"""The image-text-classification family: metrics, packaging, building, training, evaluation, simulation.

Data is the stand-in set of :mod:`fedclinic.assets.imaging_standin` (real CT/MR slices from pydicom's
bundled test files, augmented, with template reports; not chest X-rays)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from fedclinic.training import trainer as training
from fedclinic.assets.imaging_standin import STANDIN_LABELS, generate, standin_tokenizer_json
from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models import FAMILIES, build_model
from fedclinic.models.image_text import (FAMILY, IMAGE_TEXT_DEFAULTS, ImageTextModel, package_image_text_from_config,
                                         package_image_text_pretrained)
from fedclinic.evaluation.multilabel import midranks, multilabel_scores, roc_auc
from fedclinic.transport.package import META_FILE, ModelPackage

from tests.helpers.image_text_models import LABELS, TINY, examples, package


# ------------------------------------------------------------------------------------------------ metrics


def brute_force_auc(truth, scores) -> float:
    """P(s_pos > s_neg) + 0.5 P(s_pos = s_neg) over every (positive, negative) pair."""
    pos = [s for s, t in zip(scores, truth) if t]
    neg = [s for s, t in zip(scores, truth) if not t]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(40))
def test_rank_auc_equals_the_pairwise_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    truth = rng.random(n) < rng.uniform(0.1, 0.9)
    truth[0], truth[1] = True, False  # both classes present
    scores = rng.integers(0, int(rng.integers(2, 8)), size=n).astype(float)  # few distinct values: many ties
    if seed % 2:
        scores = scores + rng.normal(0, 1e-3, n) * (rng.random(n) < 0.5)
    assert roc_auc(truth, scores) == pytest.approx(brute_force_auc(truth, scores), abs=1e-12)


def test_auc_edge_cases():
    assert roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4]) == 0.0
    assert roc_auc([0, 1, 0, 1], [0.5, 0.5, 0.5, 0.5]) == 0.5  # all tied
    assert math.isnan(roc_auc([1, 1, 1], [0.1, 0.2, 0.3]))     # no negative: undefined
    np.testing.assert_array_equal(midranks(np.array([3.0, 1.0, 3.0, 2.0, 3.0])), [4, 1, 4, 2, 4])
    with pytest.raises(ValueError, match="finite"):
        roc_auc([0, 1], [0.0, float("nan")])


def test_multilabel_scores_by_hand():
    truth = np.array([[1, 0], [1, 1], [0, 0], [0, 1]])
    logits = np.array([[2.0, -1.0], [-0.5, 0.3], [-1.0, 0.2], [0.1, 1.5]])
    s = multilabel_scores(truth, logits, ["a", "b"])
    # a: predicted rows 0, 3 -> TP 1, FP 1, FN 1 -> F1 0.5; b: predicted rows 1, 2, 3 -> TP 2, FP 1, FN 0 -> 0.8
    assert s["f1/a"] == pytest.approx(0.5) and s["f1/b"] == pytest.approx(0.8)
    assert s["macro_f1"] == pytest.approx(0.65)
    assert s["auc/a"] == pytest.approx(brute_force_auc(truth[:, 0], logits[:, 0]))  # 0.75
    assert s["auc/b"] == pytest.approx(1.0)
    assert s["macro_auc"] == pytest.approx((0.75 + 1.0) / 2)
    assert s["exact_match"] == pytest.approx(1 / 4) and s["label_accuracy"] == pytest.approx(5 / 8)
    assert s["micro_f1"] == pytest.approx(2 * 3 / (2 * 3 + 2 + 1))  # TP 1+2, FP 1+1, FN 1+0
    one_class = multilabel_scores(np.array([[1, 0], [1, 1]]), logits[:2], ["a", "b"])
    assert math.isnan(one_class["auc/a"]) and one_class["macro_auc"] == one_class["auc/b"]


# ------------------------------------------------------------------------------------------------ packaging


def test_family_is_registered_and_package_is_seeded_and_all_float():
    assert FAMILY == "image-text-classification" and FAMILY in FAMILIES
    pkg = package()
    assert pkg.manifest().model_hash == package().manifest().model_hash
    assert pkg.manifest().model_hash != package(seed=1).manifest().model_hash
    assert all(a.dtype == np.float32 for a in pkg.tensors.values())
    assert not any("num_batches_tracked" in n for n in pkg.tensors)
    groups = {n.split(".")[0] for n in pkg.tensors}
    assert groups == {"image_encoder", "image_proj", "text_embedding", "text_lstm", "text_proj", "fusion", "classifier"}
    assert "text_lstm.weight_ih_l0_reverse" in pkg.tensors  # bidirectional by default (the report)
    assert pkg.tensors["image_encoder.embedder.embedder.convolution.weight"].shape[1] == 1  # one gray channel
    assert pkg.tensors["classifier.weight"].shape == (3, 16)
    meta = pkg.meta
    assert meta["multi_label"] is True and meta["architecture"] == "resnet-bilstm"
    assert meta["arch_config"]["image_size"] == 32 and meta["arch_config"]["vocab_size"] > 4


def test_default_image_branch_is_a_resnet50_on_one_channel():
    from transformers import ResNetConfig, ResNetModel

    pkg = package_image_text_from_config(labels=LABELS, tokenizer_json=standin_tokenizer_json())
    resnet50 = ResNetModel(ResNetConfig(num_channels=1))  # transformers' defaults are ResNet-50's shape
    expected = sum(p.numel() for p in resnet50.parameters())
    got = sum(a.size for n, a in pkg.tensors.items()
              if n.startswith("image_encoder.") and not n.endswith(("running_mean", "running_var")))
    # torchvision's ResNet-50 without its fc layer has 23,508,032 parameters; one input channel instead of three
    # removes 2 x 64 x 7 x 7 = 6,272 stem weights
    assert got == expected == 23_508_032 - 6_272
    assert IMAGE_TEXT_DEFAULTS["image_size"] == 224 and pkg.tensors["text_lstm.weight_hh_l0"].shape == (512, 128)


@pytest.mark.parametrize("config, message", [
    ({"colour": 3}, r"unknown image-text-classification config key\(s\) \['colour'\]"),
    ({"image_size": 4}, "image_size must be >= 8"),
    ({"resnet_depths": [1]}, "one entry per stage"),
    ({"resnet_layer_type": "wide"}, "resnet_layer_type must be 'basic' or 'bottleneck'"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"bidirectional": "yes"}, "bidirectional must be true or false"),
    ({"image_std": 0}, "image_std must be > 0"),
    ({"lstm_hidden": 0}, "lstm_hidden must be a positive integer"),
])
def test_bad_config_is_refused(config, message):
    with pytest.raises(ConfigError, match=message):
        package(**config)


def test_labels_and_architecture_are_checked():
    with pytest.raises(ConfigError, match="labels must be unique"):
        package_image_text_from_config(labels=["a", "a"], tokenizer_json=standin_tokenizer_json(), config=TINY)
    with pytest.raises(ConfigError, match="unknown architecture 'resnet-gru'"):
        package_image_text_from_config(labels=LABELS, tokenizer_json=standin_tokenizer_json(), config=TINY,
                                       architecture="resnet-gru")


def test_build_refuses_tampered_packages():
    pkg = package()
    meta = pkg.meta
    bad = ModelPackage(tensors=pkg.tensors, files={**pkg.files, META_FILE: json.dumps({**meta, "multi_label": False}).encode()})
    with pytest.raises(IntegrityError, match="must say multi_label: true"):
        build_model(bad)
    arch = {**meta["arch_config"], "vocab_size": 3}
    bad = ModelPackage(tensors=pkg.tensors, files={**pkg.files, META_FILE: json.dumps({**meta, "arch_config": arch}).encode()})
    with pytest.raises(IntegrityError, match="declares vocab_size 3"):
        build_model(bad)
    tensors = dict(pkg.tensors)
    del tensors["classifier.bias"]
    with pytest.raises(IntegrityError, match="missing tensor"):
        build_model(ModelPackage(tensors=tensors, files=pkg.files))


# ------------------------------------------------------------------------------------------------ forward and loss


def test_padding_does_not_change_the_output_and_loss_is_mean_bce():
    import torch

    model = build_model(package())
    assert isinstance(model, ImageTextModel)
    px = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[2, 5, 6, 3], [2, 7, 3, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    z = model.logits(px, ids, mask)
    padded = model.logits(px, torch.cat([ids, torch.zeros(2, 5, dtype=ids.dtype)], 1),
                          torch.cat([mask, torch.zeros(2, 5, dtype=mask.dtype)], 1))
    torch.testing.assert_close(z, padded)
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    p = torch.sigmoid(z.detach().double())
    manual = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    with torch.no_grad():
        loss = float(model.training_loss((px, ids, mask), y))
    assert loss == pytest.approx(float(manual), rel=1e-5)


def test_frozen_batch_norm_keeps_its_statistics(tmp_path):
    model = build_model(package())
    data = training.encode(examples(tmp_path, 16, seed=3), model)
    before = {n: a.copy() for n, a in package().tensors.items()}
    heads = [n for n in before if not n.startswith("image_encoder.")]
    training.train_local(model, data, training.TrainConfig(local_epochs=1, batch_size=8, learning_rate=1e-2),
                         trainable=heads)
    from fedclinic.models import module_tensors

    after = module_tensors(model.module)
    stats = [n for n in before if n.endswith(("running_mean", "running_var"))]
    assert stats and all(np.array_equal(before[n], after[n]) for n in before if n.startswith("image_encoder."))
    assert any(not np.array_equal(before[n], after[n]) for n in heads)
    # trained, the encoder's batch norm updates its running statistics
    training.train_local(model, data, training.TrainConfig(local_epochs=1, batch_size=8, learning_rate=1e-2),
                         trainable=list(before))
    after = module_tensors(model.module)
    assert all(not np.array_equal(before[n], after[n]) for n in stats)


# ------------------------------------------------------------------------------------------------ training


def test_training_learns_the_standin_set(tmp_path):
    model = build_model(package())
    train = training.encode(examples(tmp_path / "train", 64, seed=1, image_format="dicom"), model)
    test = training.encode(examples(tmp_path / "test", 32, seed=2), model)
    assert train.pixel_values.shape == (64, 1, 32, 32) and train.labels.shape == (64, 3)
    before = training.evaluate(model, test)
    training.train_local(model, train, training.TrainConfig(local_epochs=10, batch_size=8, learning_rate=5e-3, seed=0),
                         trainable=list(package().tensors))
    after = training.evaluate(model, test)  # measured: macro AUC 0.986, macro F1 0.966, marker AUC 0.957 / F1 0.897
    keys = {f"{m}/{lab}" for m in ("f1", "auc") for lab in LABELS} | {"loss", "macro_f1", "macro_auc", "micro_f1",
                                                                     "exact_match", "label_accuracy", "n"}
    assert {k for k in after if not k.startswith("count/thr/")} == keys and after["n"] == 32
    assert sum(v for k, v in after.items() if k.startswith("count/thr/0/")) == 32  # every row once per label
    assert after["loss"] < before["loss"] * 0.5
    assert after["macro_auc"] > 0.95 and after["macro_f1"] > 0.9, after
    # the finding only the image always shows (reports mention it 75 % of the time); untrained: AUC 0.54, F1 0.67
    assert after["auc/marker"] > 0.9 and after["f1/marker"] > 0.8, (before, after)
    # evaluation is the documented metrics on the model's logits
    import torch

    with torch.no_grad():
        logits = model.logits(*test.batch(torch.arange(len(test)), torch.device("cpu"))[0]).numpy()
    ref = multilabel_scores(test.labels.numpy(), logits, LABELS)
    assert all(after[k] == pytest.approx(v) for k, v in ref.items())
    probs = model.predict_proba([e.image for e in examples(tmp_path / "more", 4, seed=9)], ["see image"] * 4)
    assert probs.shape == (4, 3) and ((0 <= probs) & (probs <= 1)).all()


def test_encode_refuses_rows_of_other_families_and_unknown_labels(tmp_path):
    from fedclinic.data.text import Example
    from fedclinic.data.image import ImageTextExample

    model = build_model(package())
    with pytest.raises(DatasetError, match="example 0 is not an image \\+ text example"):
        training.encode([Example("text", ("ct",))], model)
    rows = examples(tmp_path, 2, seed=0)
    with pytest.raises(DatasetError, match=r"manifest.csv: row 2: label\(s\) \['xray'\] not in the model's labels"):
        training.encode([ImageTextExample(rows[0].image, "t", ("xray",), rows[0].source)], model)
    with pytest.raises(DatasetError, match="nothing to train"):
        training.encode([], model)


def test_simulation_with_fedavg_and_dynamic_weighting(tmp_path):
    from fedclinic.federation.simulate import simulate

    sites = [examples(tmp_path / f"s{i}", 12 + 4 * i, seed=10 + i, image_format="dicom" if i == 0 else "png")
             for i in range(3)]
    held_out = examples(tmp_path / "eval", 12, seed=99)
    cfg = training.TrainConfig(local_epochs=1, batch_size=8, learning_rate=3e-3, measure_gradient_change=True)
    for strategy, params in (("fedavg", {}), ("dynamic-weighting", {"definition": "code"})):
        result = simulate(package(), sites, rounds=2, train=cfg, strategy=strategy, strategy_params=params,
                          eval_data=held_out)
        assert len(result.rounds) == 2 and result.rounds[0].num_samples == 12 + 16 + 20
        assert {"macro_auc", "macro_f1", "auc/marker", "f1/ct"} <= set(result.rounds[-1].metrics)
        assert result.package.manifest().model_hash != package().manifest().model_hash


# ------------------------------------------------------------------------------------------------ pretrained ResNet


def resnet_folder(tmp_path, channels: int = 3):
    from transformers import ResNetConfig, ResNetForImageClassification

    import torch

    torch.manual_seed(0)
    net = ResNetForImageClassification(ResNetConfig(num_channels=channels, embedding_size=8, hidden_sizes=[8, 16],
                                                    depths=[1, 1], layer_type="basic", num_labels=5))
    with torch.no_grad():  # non-trivial running statistics, as a trained checkpoint has
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    folder = tmp_path / "resnet"
    net.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_bytes(standin_tokenizer_json())
    return net.eval(), folder


def test_pretrained_resnet_folder_is_loaded_with_summed_stem_filters(tmp_path):
    import torch

    net, folder = resnet_folder(tmp_path)
    pkg = package_image_text_pretrained(folder, labels=LABELS, config={"image_size": 32, "dropout": 0.0},
                                        max_length=16)
    arch = pkg.meta["arch_config"]
    assert arch["resnet_hidden_sizes"] == [8, 16] and arch["image_mean"] == pytest.approx(0.449)
    model = build_model(pkg)
    x = torch.rand(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.module.image_features(x)
        theirs = net.resnet(x.repeat(1, 3, 1, 1)).pooler_output.flatten(1)  # the gray image on three channels
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    with pytest.raises(ConfigError, match=r"config sets \['resnet_depths'\], but a pretrained ResNet's shape"):
        package_image_text_pretrained(folder, labels=LABELS, config={"resnet_depths": [2, 2]})


def test_pretrained_folder_problems_are_named(tmp_path):
    net, folder = resnet_folder(tmp_path)
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    del weights["resnet.encoder.stages.1.layers.0.shortcut.convolution.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(IntegrityError, match=r"lack tensor\(s\) 'image_encoder.encoder.stages.1.layers.0.shortcut"):
        package_image_text_pretrained(folder, labels=LABELS)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "vit"}))
    with pytest.raises(ConfigError, match="must be a transformers ResNet"):
        package_image_text_pretrained(folder, labels=LABELS)
    with pytest.raises(ConfigError, match="does not exist"):
        package_image_text_pretrained(tmp_path / "nowhere", labels=LABELS)
    tokenizer_only = tmp_path / "tokenizer-only"
    tokenizer_only.mkdir()
    with pytest.raises(ConfigError, match="has no tokenizer.json"):
        package_image_text_pretrained(tokenizer_only, labels=LABELS)
    (tokenizer_only / "tokenizer.json").write_bytes(standin_tokenizer_json())
    fresh = package_image_text_pretrained(tokenizer_only, labels=LABELS, config=TINY, max_length=16)
    assert fresh.tensors.keys() == package().tensors.keys() and fresh.meta["base_model"] == "tokenizer-only"


def test_task_validation_and_packaging_for_a_task(tmp_path):
    from fedclinic.models import package_for_task
    from fedclinic.spec.task import Task

    kw = dict(name="cxr", dataset="cxr", family=FAMILY, architecture="resnet-bilstm", labels=LABELS)
    with pytest.raises(ConfigError, match="is multi-label .* set multi_label = true"):
        Task(**kw).validate()
    with pytest.raises(ConfigError, match="architecture 'lstm' is not one of"):
        Task(**{**kw, "architecture": "lstm"}, multi_label=True).validate()
    Task(**{**kw, "labels": ["marker"]}, multi_label=True).validate()  # one finding is a valid multi-label task
    _, folder = resnet_folder(tmp_path)
    task = Task(**kw, multi_label=True, model=str(folder), max_length=16,
                model_config={"image_size": 32, "lstm_hidden": 8})
    pkg = package_for_task(task)
    assert pkg.meta["family"] == FAMILY and pkg.tensors["text_lstm.weight_hh_l0"].shape == (32, 8)
    assert task.to_spec().family == FAMILY


def test_standin_generator_is_deterministic_and_labelled():
    a, b = generate(6, seed=4), generate(6, seed=4)
    assert [x.text for x in a] == [x.text for x in b] and all(np.array_equal(x.image, y.image) for x, y in zip(a, b))
    for ex in generate(40, seed=5):
        assert ex.labels[0] == ex.modality and set(ex.labels) <= set(STANDIN_LABELS)
        assert ex.image.ndim == 2 and min(ex.image.shape) >= 44  # a crop of at least 70 % of the 64 px MR slice


def test_model_card_and_watch_line_show_the_family():
    from fedclinic.client import _headline
    from fedclinic.spec.model_card import build_card, render_markdown

    pkg = package()
    card = build_card(pkg.meta, model_hash=pkg.manifest().model_hash)
    assert card["image"] == {"channels": 1, "size": 32, "mean": 0.5, "std": 0.5, "preprocessing": "fedclinic.data_image"}
    assert "| Image input | grayscale 32 x 32, (v - 0.5) / 0.5 (fedclinic.data_image) |" in render_markdown(card)
    assert _headline({"eval_accuracy": 0.25, "eval_macro_auc": 0.9125}) == " site-eval macro AUC 0.912"
