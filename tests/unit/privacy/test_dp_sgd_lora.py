"""DP-SGD over LoRA adapters: ghost clipping's LoRA rule gives each example's exact adapter gradient norm and the
exact clipped sum (both norm formulas, with and without the base weight trained), one private step of a tiny LoRA
BERT equals the brute-force per-example computation, and Opacus' hooks mode refuses adapters with the reason."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedclinic.errors import ConfigError
from fedclinic.models import build_model, lora, package_from_config
from fedclinic.privacy.dp_sgd import DPSGD, train_local_private
from fedclinic.privacy.ghost import GhostClipping, unsupported_parameters
from fedclinic.training.trainer import TrainConfig, _batch_loss, encode, select_tensors
from tests.helpers.symptom_models import LABELS, TINY_BERT, TOK, examples

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Net(torch.nn.Module):
    """Embedding -> q (16 x 16, rank 8: both adapters take the Gram form, 3 (16 + 8) <= 16 * 8) -> down (16 -> 2,
    rank 4: B takes the direct form, 3 (4 + 2) > 4 * 2) -> mean -> head (T = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 16)
        self.q = torch.nn.Linear(16, 16)
        self.down = torch.nn.Linear(16, 2)
        self.head = torch.nn.Linear(2, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.tanh(self.q(self.emb(ids)))).mean(dim=1))


def _adapted_net() -> Net:
    torch.manual_seed(0)
    net = Net()
    ranks = {"q": 8, "down": 4, "head": 2}
    for name, rank in ranks.items():
        linear = getattr(net, name)
        spec = lora.LoraSpec(rank=rank, alpha=2.0 * rank, targets=(name,))
        adapters = {f"{name}.lora_A": np.random.default_rng(rank).normal(size=(rank, linear.in_features)),
                    f"{name}.lora_B": np.random.default_rng(rank + 1).normal(size=(linear.out_features, rank))}
        lora.attach(net, spec, {k: v.astype(np.float32) for k, v in adapters.items()})
    return net


@pytest.mark.parametrize("base_trained", [False, True])
def test_ghost_lora_norms_and_clipped_sum_equal_the_per_example_computation(base_trained):
    net = _adapted_net()
    for name, p in net.named_parameters():
        p.requires_grad_("lora_" in name or name.startswith("head.") or (base_trained and name.endswith("weight")))
    params = [p for p in net.parameters() if p.requires_grad]
    assert not unsupported_parameters(net, params)
    gen = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 11, (5, 3), generator=gen), torch.randint(0, 3, (5,), generator=gen)
    grads = [torch.autograd.grad(F.cross_entropy(net(ids[i:i + 1]), y[i:i + 1]), params) for i in range(5)]
    want_norms = torch.stack([torch.sqrt(sum(g.double().square().sum() for g in gs)) for gs in grads])
    clip = float(want_norms.median())
    assert (want_norms > clip).any() and (want_norms < clip).any()
    ghost = GhostClipping(net, params, clip)
    try:
        with ghost.recording():
            losses = F.cross_entropy(net(ids), y, reduction="none")
        norms = ghost.add_clipped_sum(losses)
    finally:
        ghost.close()
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-5, atol=1e-7)
    for k, p in enumerate(params):
        want = sum(gs[k] * min(1.0, clip / float(n)) for gs, n in zip(grads, want_norms))
        # float32, batched against one example at a time: the two matmul paths round differently, by how much
        # depends on the CPU's vector unit (up to 1e-5 absolute on an AVX2-only CPU); a wrong clip is far larger
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=2e-5)


def test_a_parameter_on_a_linear_that_no_rule_covers_is_unsupported():
    """A Linear carrying adapters without their scaling (not attached by fedclinic.models.lora) is refused rather
    than clipped on a norm that misses them."""
    net = _adapted_net()
    del net.q.lora_scaling
    assert unsupported_parameters(net, [net.q.lora_A, net.q.lora_B]) == ["q.lora_A", "q.lora_B"]


def _lora_bert():
    base = package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=TOK,
                               config={**TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                               max_length=32, seed=1)
    pkg = lora.add_adapters(base, lora.LoraSpec(rank=4, alpha=8, seed=3))
    # B starts at zero (so A's gradient is zero): a trained-looking B exercises both adapters' rules
    tensors = dict(pkg.tensors)
    for name in tensors:
        if name.endswith(lora.B_SUFFIX):
            tensors[name] = np.random.default_rng(len(name)).normal(0, 0.5, tensors[name].shape).astype(np.float32)
    loaded = build_model(type(pkg)(tensors=tensors, files=pkg.files))
    trainable = select_tensors(loaded.module.state_dict(), lora.trainable_patterns())
    return loaded, trainable


@pytest.mark.parametrize("batch_size", [6, 4])
def test_one_private_lora_step_equals_the_brute_force_clipped_sum(batch_size):
    """sample rate 1, negligible noise, sgd with lr 1: the step is -sum_i clip(g_i) / n over the adapters and the
    head, where g_i is example i's gradient alone (torch.autograd per example); the encoder stays as it was."""
    loaded, trainable = _lora_bert()
    assert any(".lora_A" in n for n in trainable) and "classifier.weight" in trainable
    data = encode(examples(6), loaded, max_length=16)
    reference = copy.deepcopy(loaded)
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    cfg = TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=batch_size, max_grad_norm=0.0, seed=0)
    clip = 0.05
    train_local_private(loaded, data, cfg, DPSGD(1e-9, clip, 1.0, 1), trainable=trainable, mode="ghost")

    reference.module.train()
    loss_fn = _batch_loss(reference, data.multi_label)
    named = [(n, p) for n, p in reference.module.named_parameters() if n in set(trainable)]
    total = [torch.zeros_like(p) for _, p in named]
    for i in range(len(data)):
        inputs, y = data.batch(torch.tensor([i]), torch.device("cpu"))
        grads = torch.autograd.grad(loss_fn(inputs, y), [p for _, p in named])
        scale = min(1.0, clip / float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
        assert scale < 1.0  # every example is clipped: the test checks the norms, not only the sum
        for acc, g in zip(total, grads):
            acc += g * scale
    after = {n: p.detach() for n, p in loaded.module.named_parameters()}
    for (name, _), g in zip(named, total):
        torch.testing.assert_close(after[name], before[name] - g / len(data), rtol=1e-4, atol=1e-6, msg=name)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in set(trainable))
    assert any(not torch.equal(after[n], before[n]) for n in trainable if n.endswith(".lora_A"))


def test_hooks_mode_refuses_adapters_with_the_reason():
    loaded, trainable = _lora_bert()
    data = encode(examples(4), loaded, max_length=16)
    with pytest.raises(ConfigError, match="own weight and bias only"):
        train_local_private(loaded, data, TrainConfig(optimizer="sgd"), DPSGD(1.0, 1.0, 0.5, 1),
                            trainable=trainable, mode="hooks")
