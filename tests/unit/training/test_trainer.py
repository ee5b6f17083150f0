"""fedclinic.training.trainer: the shared local trainer (config, devices, tensor selection, encode, train, evaluate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedclinic.data.text import Example
from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models import load_tensors, module_tensors
from fedclinic.proto import task_pb2
from fedclinic.training.trainer import (
    TrainConfig,
    compute_delta,
    encode,
    evaluate,
    select_device,
    select_tensors,
    train_local,
)

from tests.helpers.symptom_models import KEYWORDS, LABELS, examples, model


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


# ------------------------------------------------------------------------------------------------ config


def test_train_config_defaults_and_validation():
    cfg = TrainConfig()
    assert (cfg.local_epochs, cfg.batch_size, cfg.learning_rate, cfg.optimizer, cfg.max_grad_norm, cfg.device) == (
        1, 16, 5e-5, "adamw", 1.0, "auto")
    with pytest.raises(ConfigError, match=r"optimizer 'lamb' is unknown; choose one of adamw, adam, sgd"):
        TrainConfig(optimizer="lamb")
    with pytest.raises(ConfigError, match=r"batch_size must be an integer >= 1, got 0.*learning_rate must be a "
                                          r"finite number > 0"):
        TrainConfig(batch_size=0, learning_rate=-1.0)
    with pytest.raises(ConfigError, match="proximal_mu must be a finite number >= 0"):
        TrainConfig(proximal_mu=-0.1)
    with pytest.raises(ConfigError, match="max_steps must be an integer >= 0"):
        TrainConfig(max_steps=-1)


def test_train_config_from_proto_zero_means_default():
    cfg = TrainConfig.from_proto(task_pb2.TrainingConfig())
    assert cfg.local_epochs == 1 and cfg.batch_size == 16 and cfg.learning_rate == 5e-5
    assert cfg.optimizer == "adamw" and cfg.max_length == 128
    assert cfg.max_grad_norm == 0.0  # the protocol documents 0 as "clipping off"; Task always sends its value
    msg = task_pb2.TrainingConfig(local_epochs=3, batch_size=8, learning_rate=1e-3, optimizer="sgd", weight_decay=0.1,
                                  max_grad_norm=2.0, max_steps=7, mixed_precision=True, proximal_mu=0.01,
                                  max_length=64, seed=9)
    cfg = TrainConfig.from_proto(msg, device="cpu")
    assert cfg == TrainConfig(local_epochs=3, batch_size=8, learning_rate=1e-3, optimizer="sgd", weight_decay=0.1,
                              max_grad_norm=2.0, max_steps=7, mixed_precision=True, proximal_mu=0.01, max_length=64,
                              seed=9, device="cpu")
    with pytest.raises(ConfigError, match="optimizer 'rmsprop' is unknown"):
        TrainConfig.from_proto(task_pb2.TrainingConfig(optimizer="rmsprop"))


def test_select_device(monkeypatch):
    assert select_device("cpu").type == "cpu"
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="unknown device 'tpu'; use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        select_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto").type == "cpu"
    with pytest.raises(ConfigError, match=r"device 'cuda:1' requested but CUDA is not available.*use device 'auto'"):
        select_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"only 1 CUDA device\(s\) are visible"):
        select_device("cuda:3")


# ------------------------------------------------------------------------------------------ tensor selection

NAMES = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.output.dense.weight",
         "bert.encoder.layer.1.output.dense.weight", "bert.pooler.dense.weight", "classifier.weight",
         "classifier.bias"]


def test_select_tensors():
    assert select_tensors(NAMES) == NAMES
    assert select_tensors(NAMES, [r"classifier\..*", r"bert\.encoder\.layer\.1\..*"]) == [NAMES[2], NAMES[4], NAMES[5]]
    assert select_tensors(NAMES, (), [r"bert\.embeddings\..*"]) == NAMES[1:]
    assert select_tensors(NAMES, [r"classifier\..*"], [r".*\.bias"]) == ["classifier.weight"]
    # fullmatch: a prefix is not enough
    with pytest.raises(ConfigError, match=r"trainable pattern 'classifier' matches no tensor \(patterns must match "
                                          r"the whole name\)"):
        select_tensors(NAMES, ["classifier"])
    with pytest.raises(ConfigError, match=r"frozen pattern '\(' is not a valid regular expression"):
        select_tensors(NAMES, (), ["("])
    with pytest.raises(ConfigError, match="no tensor is left to train"):
        select_tensors(NAMES, [r"classifier\..*"], [r"classifier\..*"])
    with pytest.raises(ConfigError, match="lists of regular expressions, not one string"):
        select_tensors(NAMES, r"classifier\..*")


# ------------------------------------------------------------------------------------------------ encode


def test_encode_single_and_multi_label():
    _, loaded = model()
    data = encode([Example("fever cough", ("resp",)), Example("rash", ("skin",))], loaded, max_length=16)
    assert data.input_ids.dtype == torch.int64 and data.input_ids.shape == (2, 4)
    assert data.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert data.input_ids[1, 3] == loaded.pad_id
    assert data.labels.tolist() == [0, 1] and len(data) == 2
    trunc = encode([Example(" ".join(["fever"] * 50), ("resp",))], loaded, max_length=8)
    assert trunc.input_ids.shape == (1, 8) and trunc.input_ids[0, -1] == loaded.tokenizer.token_to_id("[SEP]")
    _, multi = model(multi=True)
    mdata = encode([Example("fever rash", ("resp", "skin"))], multi, max_length=16)
    assert mdata.labels.dtype == torch.float32 and mdata.labels.tolist() == [[1.0, 1.0, 0.0]]


def test_encode_errors():
    _, loaded = model()
    with pytest.raises(DatasetError, match=r"example 0: label\(s\) \['gout'\] not in the model's labels"):
        encode([Example("x", ("gout",))], loaded)
    with pytest.raises(DatasetError, match="example 0: 2 labels in a single-label task"):
        encode([Example("x", ("resp", "gi"))], loaded)
    with pytest.raises(DatasetError, match="the dataset is empty"):
        encode([], loaded)


# ------------------------------------------------------------------------------------------------ train


@pytest.mark.parametrize("arch,lr", [("logreg", 0.1), ("lstm", 0.02), ("transformer", 3e-3)])
def test_training_learns_and_only_trainable_tensors_move(arch, lr):
    pkg, loaded = model(arch)
    data = encode(examples(60), loaded, max_length=32)
    names = list(pkg.tensors)
    trainable = [n for n in names if not n.startswith(("embedding.", "bert.embeddings."))]
    frozen = [n for n in names if n not in trainable]
    before = module_tensors(loaded.module)
    first = evaluate(loaded, data)["loss"]
    steps = []
    result = train_local(loaded, data, TrainConfig(learning_rate=lr, local_epochs=3, batch_size=8, device="cpu"),
                         trainable=trainable, progress=lambda s, t, loss: steps.append((s, t)))
    assert result.num_samples == 60 and result.steps == 24 and steps[-1] == (24, 24)
    assert [s for s, _ in steps] == list(range(1, 25))
    after = module_tensors(loaded.module)
    assert all(np.array_equal(before[n], after[n]) for n in frozen)
    assert all(not np.array_equal(before[n], after[n]) for n in trainable)
    assert evaluate(loaded, data)["loss"] < first


def test_training_is_deterministic_per_seed_and_leaves_the_callers_rng_alone():
    def run(seed):
        pkg, loaded = model("lstm", dropout=0.5)
        data = encode(examples(40), loaded, max_length=32)
        train_local(loaded, data, TrainConfig(learning_rate=0.01, batch_size=8, seed=seed), trainable=list(pkg.tensors))
        return module_tensors(loaded.module)

    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    a = run(1)
    assert torch.equal(torch.rand(2), expected)
    b, c = run(1), run(2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], c[k]) for k in a)


def test_max_steps_caps_and_progress_can_cancel():
    pkg, loaded = model()
    data = encode(examples(40), loaded)
    res = train_local(loaded, data, TrainConfig(learning_rate=0.1, batch_size=4, local_epochs=5, max_steps=3),
                      trainable=list(pkg.tensors))
    assert res.steps == 3

    class Cancel(Exception):
        pass

    def progress(step, total, loss):
        if step == 2:
            raise Cancel

    with pytest.raises(Cancel):
        train_local(loaded, data, TrainConfig(learning_rate=0.1, batch_size=4), trainable=list(pkg.tensors),
                    progress=progress)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.5), ("adam", 0.05), ("adamw", 0.05)])
def test_optimizers(optimizer, lr):
    pkg, loaded = model()
    data = encode(examples(60), loaded)
    train_local(loaded, data, TrainConfig(optimizer=optimizer, learning_rate=lr, local_epochs=3, batch_size=8,
                                          weight_decay=0.01, max_grad_norm=0.0), trainable=list(pkg.tensors))
    assert evaluate(loaded, data)["accuracy"] >= 0.95


def test_fedprox_term_pulls_towards_the_round_start():
    def moved(mu):
        pkg, loaded = model()
        data = encode(examples(60), loaded)
        before = module_tensors(loaded.module)
        train_local(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.2, local_epochs=3, batch_size=8,
                                              proximal_mu=mu, max_grad_norm=0.0), trainable=list(pkg.tensors))
        after = module_tensors(loaded.module)
        return sum(float(np.sum((after[k] - before[k]) ** 2)) for k in before) ** 0.5

    assert moved(4.0) < 0.6 * moved(0.0)


def test_mixed_precision_is_ignored_on_cpu():
    def run(mp):
        pkg, loaded = model()
        data = encode(examples(30), loaded)
        train_local(loaded, data, TrainConfig(learning_rate=0.1, mixed_precision=mp, device="cpu"),
                    trainable=list(pkg.tensors))
        return module_tensors(loaded.module)

    a, b = run(True), run(False)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_multi_label_training():
    pkg, loaded = model("logreg", multi=True)
    data = encode(examples(90, multi=True), loaded)
    train_local(loaded, data, TrainConfig(learning_rate=0.05, local_epochs=8, batch_size=8),
                trainable=list(pkg.tensors))
    metrics = evaluate(loaded, data)
    assert metrics["exact_match"] >= 0.9 and metrics["macro_f1"] >= 0.9


def test_train_local_errors():
    pkg, loaded = model()
    data = encode(examples(10), loaded)
    with pytest.raises(ConfigError, match=r"trainable names unknown to the model: \['nope'\]"):
        train_local(loaded, data, TrainConfig(), trainable=["nope"])
    cfg = TrainConfig()
    cfg.optimizer = "bogus"  # mutated after construction (agents set fields): still validated
    with pytest.raises(ConfigError, match="optimizer 'bogus' is unknown"):
        train_local(loaded, data, cfg, trainable=list(pkg.tensors))
    _, other = model(multi=True)
    with pytest.raises(ConfigError, match="encoded data was made for a different label set"):
        train_local(other, data, TrainConfig(), trainable=list(pkg.tensors))


def test_divergence_is_reported():
    pkg, loaded = model()
    data = encode(examples(10), loaded)
    load_tensors(loaded.module, {"bias": np.array([np.nan, 0, 0], np.float32)})
    with pytest.raises(IntegrityError, match="training diverged"):
        train_local(loaded, data, TrainConfig(max_grad_norm=0.0), trainable=list(pkg.tensors))


# ------------------------------------------------------------------------------------------------ evaluate


def _fixed_logreg():
    """A logreg whose prediction is decided by one keyword per class; 'the' alone predicts class 0 via bias."""
    pkg, loaded = model()
    tok = loaded.tokenizer
    w = np.zeros_like(pkg.tensors["token_weights.weight"])
    for c, lab in enumerate(LABELS):
        w[tok.token_to_id(KEYWORDS[lab][0]), c] = 5.0
    load_tensors(loaded.module, {"token_weights.weight": w, "bias": np.array([1.0, 0.0, 0.0], np.float32)})
    return loaded


def test_evaluate_metrics_match_hand_computation():
    loaded = _fixed_logreg()
    rows = [Example("fever", ("resp",)), Example("rash", ("skin",)), Example("nausea", ("gi",)),
            Example("the", ("gi",)),  # predicted resp (bias) -> wrong
            Example("rash", ("resp",))]  # predicted skin -> wrong
    m = evaluate(loaded, encode(rows, loaded), batch_size=2)
    assert m["n"] == 5.0 and m["accuracy"] == pytest.approx(3 / 5)
    # per-class F1: resp tp1 fp1 fn1 -> 0.5; skin tp1 fp1 fn0 -> 2/3; gi tp1 fp0 fn1 -> 2/3
    assert m["macro_f1"] == pytest.approx((0.5 + 2 / 3 + 2 / 3) / 3)
    enc = encode(rows, loaded)
    with torch.no_grad():
        logits = loaded.logits(enc.input_ids, enc.attention_mask)
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2, 2, 0]))
    assert m["loss"] == pytest.approx(float(ce), rel=1e-5)


def test_evaluate_multi_label_exact_match_and_absent_labels_score_zero():
    pkg, loaded = model(multi=True)
    tok = loaded.tokenizer
    w = np.zeros_like(pkg.tensors["token_weights.weight"])
    w[tok.token_to_id("fever"), 0] = 5.0
    w[tok.token_to_id("rash"), 1] = 5.0
    load_tensors(loaded.module, {"token_weights.weight": w, "bias": np.full(3, -1.0, np.float32)})
    rows = [Example("fever rash", ("resp", "skin")), Example("fever", ("resp", "skin"))]
    m = evaluate(loaded, encode(rows, loaded))
    assert m["exact_match"] == 0.5 and "accuracy" not in m  # exact match is not called plain accuracy
    # resp F1 1.0; skin tp1 fn1 -> 2/3; gi: no true, no predicted -> 0 (zero_division=0)
    assert m["macro_f1"] == pytest.approx((1.0 + 2 / 3 + 0.0) / 3)
    assert m["f1/resp"] == 1.0 and m["f1/skin"] == pytest.approx(2 / 3) and m["f1/gi"] == 0.0
    assert m["micro_f1"] == pytest.approx(2 * 3 / (2 * 3 + 0 + 1))  # TP 2+1, FP 0, FN 1
    assert np.isnan(m["auc/gi"]) and np.isnan(m["auc/skin"])  # one class only in the rows: AUC undefined (NaN)
    # the threshold histograms: bin(z) = #{k : z >= 8 (2k/50 - 1)}, so logit 4 -> bin 37 and logit -1 -> bin 21
    assert m["count/thr/0/37/pos"] == 2 and m["count/thr/1/37/pos"] == 1 and m["count/thr/1/21/pos"] == 1
    assert m["count/thr/2/21/neg"] == 2 and sum(v for k, v in m.items() if k.startswith("count/thr/2/")) == 2


def test_pos_weight_changes_the_loss_as_bce_with_pos_weight_should():
    pkg, loaded = model("logreg", multi=True)
    data = encode(examples(12, multi=True), loaded)
    load_tensors(loaded.module, {"bias": np.array([0.3, -0.2, -1.0], np.float32)})
    logits = loaded.logits(data.input_ids, data.attention_mask).detach().double()
    y = data.labels.double()
    w = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)
    # the definition, written out: -[w y log s(z) + (1 - y) log(1 - s(z))], mean over rows and labels
    s = torch.sigmoid(logits)
    by_hand = float(-(w * y * torch.log(s) + (1 - y) * torch.log(1 - s)).mean())
    unweighted = float(-(y * torch.log(s) + (1 - y) * torch.log(1 - s)).mean())
    seen = []
    train_local(loaded, data, TrainConfig(learning_rate=1e-9, batch_size=12, max_steps=1, pos_weight=(1.0, 4.0, 9.0)),
                trainable=list(pkg.tensors), progress=lambda step, total, loss: seen.append(loss))
    assert seen[0] == pytest.approx(by_hand, rel=1e-5) and abs(by_hand - unweighted) > 0.1
    # the proto carries it; a weight per label is required, and only positive finite ones
    msg = task_pb2.TrainingConfig(pos_weight=[1.0, 4.0, 9.0])
    assert TrainConfig.from_proto(msg).pos_weight == (1.0, 4.0, 9.0)
    with pytest.raises(ConfigError, match="pos_weight values must be positive finite"):
        TrainConfig(pos_weight=(1.0, 0.0, float("inf")))
    with pytest.raises(ConfigError, match="one value per label"):
        train_local(loaded, data, TrainConfig(pos_weight=(2.0, 2.0)), trainable=list(pkg.tensors))


# ------------------------------------------------------------------------------------------------ delta


def test_compute_delta():
    before = {"a": np.ones((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    after = {"a": np.full((2, 2), 3.0, np.float32), "b": np.arange(3, dtype=np.float64)}
    d = compute_delta(before, after, ["a", "b"])
    assert d["a"].dtype == np.float32 and d["b"].dtype == np.float32
    np.testing.assert_array_equal(d["a"], 2.0)
    np.testing.assert_array_equal(d["b"], [0, 1, 2])
    assert list(compute_delta(before, after, ["b"])) == ["b"]
    with pytest.raises(IntegrityError, match="tensor 'c' is missing from the before weights"):
        compute_delta(before, after, ["c"])
    with pytest.raises(IntegrityError, match=r"tensor 'a' changed shape \(2, 2\) -> \(4,\)"):
        compute_delta(before, {"a": np.zeros(4, np.float32)}, ["a"])
