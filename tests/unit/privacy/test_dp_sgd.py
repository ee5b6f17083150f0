"""DP-SGD at the site: per-example clipping is exact, BERT works through explicit ids, noise is unpredictable,
unsupported models are refused with the alternative."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from fedclinic.errors import ConfigError
from fedclinic.privacy import dp_sgd
from fedclinic.privacy.dp_sgd import DPSGD, check_supported, explicit_ids_hook, train_local_private
from fedclinic.training.trainer import TrainConfig, _batch_loss, encode, select_tensors
from tests.helpers.symptom_models import examples, model


def _trainable(loaded):
    return select_tensors(loaded.module.state_dict())


def _weights(loaded):
    return {n: p.detach().clone() for n, p in loaded.module.named_parameters()}


@pytest.mark.parametrize("mode, batch_size, multi, pooling", [
    ("hooks", 6, False, "cls"), ("hooks", 4, False, "cls"), ("ghost", 6, False, "cls"), ("ghost", 4, False, "cls"),
    ("ghost", 6, True, "cls"),
    ("auto", 6, True, "cls"), ("hooks", 6, False, "mean"), ("ghost", 4, False, "mean")])
def test_one_step_equals_clipped_per_example_gradients(mode, batch_size, multi, pooling):
    """sample rate 1 (every example in the batch) and negligible noise: the step is -lr * sum_i clip(g_i) / n
    (dropout off, so the per-example reference passes see the same network); ghost clipping processes a sample
    larger than the batch size in parts (4 + 2) and gives the same step; multi-label and mean pooling too."""
    _, loaded = model("transformer", multi=multi, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      pooling=pooling)
    data = encode(examples(6, multi=multi), loaded, max_length=16)
    clip = 0.05
    reference = copy.deepcopy(loaded)
    before = _weights(loaded)
    cfg = TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=batch_size, max_grad_norm=0.0, seed=0)
    train_local_private(loaded, data, cfg, DPSGD(1e-9, clip, 1.0, 1), trainable=_trainable(loaded), mode=mode)

    reference.module.train()
    loss_fn = _batch_loss(reference, data.multi_label)
    params = [p for _, p in reference.module.named_parameters()]
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(data)):
        inputs, y = data.batch(torch.tensor([i]), torch.device("cpu"))
        grads = torch.autograd.grad(loss_fn(inputs, y), params, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        scale = min(1.0, clip / float(norm))
        for acc, g in zip(total, grads):
            acc += g * scale
    after = _weights(loaded)
    for (name, p), g in zip(reference.module.named_parameters(), total):
        want = before[name] - g / len(data)
        torch.testing.assert_close(after[name], want, rtol=1e-4, atol=1e-6, msg=name)
    assert any(not torch.equal(before[n], after[n]) for n in before)


def _one_private_step(with_hook: bool) -> set[int]:
    """Opacus' own hooks + DPOptimizer on a tiny BERT; returns the per-sample batch sizes it saw."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    _, loaded = model("transformer")
    data = encode(examples(4), loaded, max_length=16)
    (ids, mask), y = data.batch(torch.arange(4), torch.device("cpu"))
    handles = explicit_ids_hook(loaded.module) if with_hook else []
    loaded.module.train()  # Opacus records activations in training mode only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModule(loaded.module)
        opt = DPOptimizer(torch.optim.SGD(loaded.module.parameters(), lr=0.1), noise_multiplier=1.0,
                          max_grad_norm=1.0, expected_batch_size=4)
    try:
        torch.nn.functional.cross_entropy(gsm(input_ids=ids, attention_mask=mask).logits, y).backward()
        dims = {p.grad_sample.shape[0] for p in loaded.module.parameters() if p.grad_sample is not None}
        opt.step()
        return dims
    finally:
        gsm._close()
        for h in handles:
            h.remove()


def test_bert_needs_per_example_ids_and_gets_them():
    """The issue's failure (broadcast position/token-type ids) reproduced without the hook, fixed with it."""
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        _one_private_step(with_hook=False)
    assert _one_private_step(with_hook=True) == {4}


def test_the_noise_does_not_follow_the_task_seed():
    outs = []
    for _ in range(2):
        _, loaded = model("transformer")
        data = encode(examples(20), loaded, max_length=16)
        train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.5, seed=7),
                            DPSGD(1.0, 1.0, 0.5, 3), trainable=_trainable(loaded))
        outs.append(np.concatenate([p.detach().numpy().ravel() for p in loaded.module.parameters()]))
    assert not np.allclose(outs[0], outs[1])


def test_poisson_steps_and_progress():
    _, loaded = model("transformer")
    data = encode(examples(30), loaded, max_length=16)
    seen = []
    result = train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.1),
                                 DPSGD(1.0, 1.0, 0.2, 5), trainable=_trainable(loaded),
                                 progress=lambda s, t, loss: seen.append((s, t)))
    assert result.steps == 5 and result.num_samples == 30
    assert seen and all(t == 5 for _, t in seen) and seen[-1][0] <= 5
    assert all(not hasattr(p, "grad_sample") or p.grad_sample is None for p in loaded.module.parameters())
    assert not loaded.module._forward_pre_hooks  # the id hook is gone


@pytest.mark.parametrize("family, arch", [("text-classification", "gru"), ("tabular-regression", "logreg")])
def test_unsupported_models_are_refused_with_the_alternative(family, arch):
    with pytest.raises(ConfigError, match="use client-level DP"):
        check_supported(family, arch)


def test_settings_that_do_not_combine_with_dp_are_refused():
    _, loaded = model("transformer")
    data = encode(examples(4), loaded, max_length=16)
    with pytest.raises(ConfigError, match="proximal_mu"):
        train_local_private(loaded, data, TrainConfig(proximal_mu=0.1), DPSGD(1.0, 1.0, 0.5, 1),
                            trainable=_trainable(loaded))
    with pytest.raises(ConfigError, match="noise_multiplier must be positive"):
        DPSGD(0.0, 1.0, 0.5, 1)
    with pytest.raises(ConfigError, match="sample rate"):
        DPSGD(1.0, 1.0, 1.5, 1)
    assert dp_sgd.SUPPORTED["text-classification"] == ("transformer", "lstm", "logreg")


def test_auto_mode_picks_ghost_clipping_and_the_accountant_hook_sees_every_noisy_step():
    """Text classification runs single-pass ghost clipping by default; Opacus' accountant hook, fed the step
    record after every noise draw (empty Poisson samples included: noise-only steps), ends at (sigma, q, steps)."""
    from opacus.accountants import RDPAccountant

    from fedclinic.privacy.dp_sgd import NoisyStep

    _, loaded = model("transformer")
    data = encode(examples(6), loaded, max_length=16)
    sigma, q, steps = 1.3, 0.05, 6  # (1 - q)^6 = 0.74: most samples are empty
    accountant, seen = RDPAccountant(), []
    hook = accountant.get_optimizer_hook_fn(sample_rate=q)
    before = _weights(loaded)
    train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.1), DPSGD(sigma, 1.0, q, steps),
                        trainable=_trainable(loaded), step_hook=lambda step: (seen.append(step), hook(step)))
    assert len(seen) == steps and all(isinstance(s, NoisyStep) for s in seen)
    assert seen[0].expected_batch_size == 1 and seen[0].noise_multiplier == sigma
    assert accountant.history == [(sigma, q, steps)]
    assert all(not torch.equal(before[n], p) for n, p in loaded.module.named_parameters())  # noise everywhere
    assert all(p.grad is None and p.requires_grad for p in loaded.module.parameters())
