"""DP-SGD for the models without layer rules or grad samplers -- the text LSTM, the bag-of-tokens logreg, FedNER's
CNN-BiLSTM-CRF, the image-text ResNet + BiLSTM, and LoRA adapters outside ghost clipping's families -- by
differentiating each example alone: one step equals the brute-force clipped sum, batch normalisation is frozen
(and why it must be), Opacus' hooks mode is refused for them, and a private round runs through the simulator's
site round."""

from __future__ import annotations

import copy

import pytest
import torch

from fedclinic.errors import ConfigError
from fedclinic.federation.simulate import SampleDP, simulate
from fedclinic.models import build_model, lora
from fedclinic.privacy.dp_sgd import DPSGD, freeze_batch_norm, train_local_private
from fedclinic.spec.capabilities import SUPPORTED, check_supported
from fedclinic.training.trainer import TrainConfig, _batch_loss, encode

from tests.helpers import fedner_models, image_text_models, ner_models
from tests.helpers import symptom_models as symptom

pytestmark = pytest.mark.usefixtures("torch_one_thread")
KINDS = ["lstm", "logreg", "fedner", "image-text", "ner-lora"]


def _model_and_data(kind: str, folder, n: int = 6):
    """A tiny model of ``kind`` (no dropout, so that the per-example reference sees the same network) and data."""
    if kind in ("lstm", "logreg"):
        extra = {"dropout": 0.0, "num_layers": 2} if kind == "lstm" else {}
        _, loaded = symptom.model(kind, **extra)
        return loaded, encode(symptom.examples(n), loaded, max_length=16)
    if kind == "fedner":
        loaded = build_model(fedner_models.package(config={**fedner_models.TINY, "dropout": 0.0}))
        return loaded, encode(ner_models.make_examples(n, seed=3), loaded)
    if kind == "ner-lora":  # token classification has no ghost rules: adapters run the per-example loop
        base = ner_models.package("transformer")
        loaded = build_model(lora.add_adapters(base, lora.LoraSpec(rank=2, targets=(r".*\.query",))))
        loaded.module.config.hidden_dropout_prob = 0.0
        for m in loaded.module.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return loaded, encode(ner_models.make_examples(n, seed=3), loaded)
    loaded = build_model(image_text_models.package(seed=1))
    return loaded, encode(image_text_models.examples(folder, n, seed=2), loaded)


def _trainable(kind: str, loaded) -> list[str]:
    names = [n for n, _ in loaded.module.named_parameters()]
    if kind == "ner-lora":
        return [n for n in names if lora.is_adapter(n) or n.startswith("classifier.")]
    return names  # image-text: the batch norms' affine weights and biases too (exact in inference mode)


@pytest.mark.parametrize("kind", KINDS)
def test_one_step_equals_the_brute_force_clipped_sum(kind, tmp_path):
    """sample rate 1 (every example, in parts of 4 + 2), negligible noise, sgd with lr 1: the step is
    -sum_i clip(g_i) / n, g_i the gradient of example i's loss on a batch of that example alone (batch norm in
    inference mode); ``mode="auto"`` picks the per-example loop for these models."""
    loaded, data = _model_and_data(kind, tmp_path)
    trainable = _trainable(kind, loaded)
    reference = copy.deepcopy(loaded)
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    buffers = {n: b.clone() for n, b in loaded.module.named_buffers()}
    clip = 0.05
    cfg = TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=4, max_grad_norm=0.0, seed=0)
    train_local_private(loaded, data, cfg, DPSGD(1e-9, clip, 1.0, 1), trainable=trainable)

    reference.module.train()
    freeze_batch_norm(reference.module)
    loss_fn = _batch_loss(reference, data.multi_label)
    named = [(n, p) for n, p in reference.module.named_parameters() if n in set(trainable)]
    total = [torch.zeros_like(p) for _, p in named]
    scales = []
    for i in range(len(data)):
        inputs, y = data.batch(torch.tensor([i]), torch.device("cpu"))
        grads = torch.autograd.grad(loss_fn(inputs, y), [p for _, p in named], allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)]
        scales.append(min(1.0, clip / float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))))
        for acc, g in zip(total, grads):
            acc += g * scales[-1]
    assert max(scales) < 1.0  # every example is clipped: the norms are checked, not only the sum
    after = {n: p.detach() for n, p in loaded.module.named_parameters()}
    for (name, _), g in zip(named, total):
        torch.testing.assert_close(after[name], before[name] - g / len(data), rtol=1e-4, atol=1e-6, msg=name)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in set(trainable))
    for name, b in loaded.module.named_buffers():  # batch norm's running statistics were not updated
        assert torch.equal(b, buffers[name]), name


def test_batch_norm_in_training_mode_mixes_examples_and_frozen_it_does_not(tmp_path):
    """Why batch norm is frozen: in training mode example 0's loss changes with the example next to it."""
    loaded, data = _model_and_data("image-text", tmp_path, n=3)

    def loss_of_first(rows):
        inputs, y = data.batch(torch.tensor(rows), torch.device("cpu"))
        logits = loaded.logits(*inputs)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits[:1], y[:1]).detach()

    loaded.module.train()
    for m in loaded.module.modules():  # every batch norm in training mode, as a non-private round of a trained BN
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()
    assert not torch.allclose(loss_of_first([0, 1]), loss_of_first([0, 2]))
    freeze_batch_norm(loaded.module)
    torch.testing.assert_close(loss_of_first([0, 1]), loss_of_first([0, 2]))


@pytest.mark.parametrize("kind", ["lstm", "image-text", "ner-lora"])
def test_hooks_mode_is_refused_for_them_with_the_reason(kind, tmp_path):
    loaded, data = _model_and_data(kind, tmp_path, n=2)
    with pytest.raises(ConfigError, match="hooks mode has no per-sample gradients for .*use mode 'loop' or 'auto'"):
        train_local_private(loaded, data, TrainConfig(), DPSGD(1.0, 1.0, 0.5, 1), trainable=_trainable(kind, loaded),
                            mode="hooks")


def test_every_built_in_model_has_dp_sgd_and_an_unknown_one_is_refused():
    from fedclinic.models.families import FAMILIES

    assert set(SUPPORTED) == set(FAMILIES)
    for family, archs in SUPPORTED.items():
        for arch in archs:
            check_supported(family, arch)
    with pytest.raises(ConfigError, match="no per-example objective.*client-level DP"):
        check_supported("text-classification", "gru")


@pytest.mark.parametrize("kind", ["lstm", "logreg", "fedner", "image-text"])
def test_a_private_round_runs_through_the_site_round(kind, tmp_path):
    """simulate -> run_site_round -> train_local_private (auto mode) at two sites, one round: the model moves."""
    if kind in ("lstm", "logreg"):
        extra = {"dropout": 0.0} if kind == "lstm" else {}
        package, _ = symptom.model(kind, **extra)
        sites = [symptom.random_examples(8, 1), symptom.random_examples(8, 2)]
    elif kind == "fedner":
        package = fedner_models.package()
        sites = [ner_models.make_examples(8, seed=1), ner_models.make_examples(8, seed=2)]
    else:
        package = image_text_models.package(seed=1)
        sites = [image_text_models.examples(tmp_path / "a", 8, seed=1),
                 image_text_models.examples(tmp_path / "b", 8, seed=2)]
    rounds = []
    res = simulate(package, sites, rounds=1, train=TrainConfig(batch_size=4, learning_rate=0.05, seed=0),
                   dp=SampleDP(max_grad_norm=1.0, noise_multiplier=1.0),
                   site_rounds=lambda r, i, out: rounds.append(out))
    assert len(rounds) == 2 and all(out.train.steps > 0 for out in rounds)
    moved = [n for n in res.trainable if (res.package.tensors[n] != package.tensors[n]).any()]
    assert moved
