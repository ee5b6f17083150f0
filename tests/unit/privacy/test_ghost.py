"""Single-pass ghost clipping: the per-example norms and the clipped sum equal a direct per-example computation for
every layer kind and both norm formulas, a batch may be processed in parts, and what the per-layer norms cannot
cover (a tied or re-used parameter, a parameter outside a supported layer, inputs broadcast over the batch) is
refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedclinic.errors import ConfigError
from fedclinic.privacy.ghost import GhostClipping, unsupported_parameters

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Net(torch.nn.Module):
    """Embedding (with padding) -> LayerNorm -> q/k/v Linears sharing one input (the ghost-norm formula:
    T (d_in + d_out) = 3 * 32 <= d_in d_out = 256) -> down, narrow (the per-example-gradient formula:
    3 * 18 > 32, 3 * 4 > 4) -> mean over positions -> head on [B, d] (T = 1)."""

    def __init__(self, tied: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 16, padding_idx=0)
        self.norm = torch.nn.LayerNorm(16)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
        self.down = torch.nn.Linear(16, 2)
        self.narrow = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 3)
        self.tied, self.reuse = tied, reuse

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids))
        att = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2), dim=-1) @ self.v(h)
        x = self.narrow(self.down(att))
        if self.reuse:
            x = self.narrow(x)
        out = self.head(x.mean(dim=1))
        if self.tied:  # the embedding matrix read a second time, outside its layer
            out = out + F.linear(h, self.emb.weight).mean(dim=(1, 2)).unsqueeze(1)
        return out


def _data(b: int = 5):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 11, (b, 3), generator=gen)
    ids[0, 2] = 0  # padding
    ids[1, :] = torch.tensor([4, 4, 7])  # an id twice in one example
    return ids, torch.randint(0, 3, (b,), generator=gen)


def _direct(net, ids, y):
    """Each example's gradient of its own loss, alone."""
    params = [p for p in net.parameters() if p.requires_grad]
    out = []
    for i in range(len(ids)):
        loss = F.cross_entropy(net(ids[i:i + 1]), y[i:i + 1])
        out.append(torch.autograd.grad(loss, params, allow_unused=True))
    return params, [[torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)] for gs in out]


def _ghost(net, ids, y, clip, parts=1):
    params = [p for p in net.parameters() if p.requires_grad]
    ghost = GhostClipping(net, params, clip)
    norms = []
    try:
        for part in torch.arange(len(ids)).tensor_split(parts):
            with ghost.recording():
                losses = F.cross_entropy(net(ids[part]), y[part], reduction="none")
            norms.append(ghost.add_clipped_sum(losses))
    finally:
        ghost.close()
    return torch.cat(norms), [p.grad for p in params]


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("frozen", [(), ("emb.weight", "q.weight", "norm.bias")])
def test_norms_and_clipped_sum_equal_the_per_example_computation(parts, frozen):
    torch.manual_seed(0)
    net = Net()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    ids, y = _data()
    params, grads = _direct(net, ids, y)
    want_norms = torch.stack([torch.sqrt(sum(g.double().square().sum() for g in gs)) for gs in grads])
    clip = float(want_norms.median())
    assert (want_norms > clip).any() and (want_norms < clip).any()
    norms, got = _ghost(net, ids, y, clip, parts)
    torch.testing.assert_close(norms.double(), want_norms, rtol=1e-5, atol=1e-7)
    for k, p in enumerate(params):
        want = sum(gs[k] * min(1.0, clip / float(n)) for gs, n in zip(grads, want_norms))
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in net.parameters() if not p.requires_grad)
    assert not any(m._forward_hooks for m in net.modules())  # close() removed the hooks


def test_a_parameter_read_twice_is_refused():
    for net, what in ((Net(tied=True), "emb.weight"), (Net(reuse=True), "narrow.weight")):
        ids, y = _data()
        with pytest.raises(ConfigError, match=rf"{what} is read 2 times.*use mode 'hooks'"):
            _ghost(net, ids, y, 1.0)


def test_a_parameter_outside_the_supported_layers_is_refused():
    net = Net()
    net.scale = torch.nn.Parameter(torch.ones(1))
    params = list(net.parameters())
    assert unsupported_parameters(net, params) == ["scale"]
    with pytest.raises(ConfigError, match=r"Linear, LayerNorm and Embedding parameters only, not \['scale'\]"):
        GhostClipping(net, params, 1.0)
    conv = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1))
    assert unsupported_parameters(conv, list(conv.parameters())) == ["0.weight", "0.bias"]


def test_inputs_broadcast_over_the_batch_are_refused():
    lin = torch.nn.Linear(4, 2)
    ghost = GhostClipping(lin, list(lin.parameters()), 1.0)
    with ghost.recording():
        shared = lin(torch.randn(1, 3, 4))  # one row for the whole batch
        losses = (shared + torch.randn(5, 3, 2)).sum(dim=(1, 2))
    with pytest.raises(ConfigError, match="ran on a batch of 1 rows for 5 examples"):
        ghost.add_clipped_sum(losses)
    with pytest.raises(ValueError, match=r"one loss per example"):
        ghost.add_clipped_sum(losses.sum())


def test_private_feature_logreg_step_equals_the_per_example_computation():
    """The feature-classification logreg through DP-SGD's default (ghost) mode, sample rate 1, negligible noise."""
    import numpy as np

    from fedclinic.models.feature_classification import build, encode_features, package_feature_model
    from fedclinic.privacy.dp_sgd import DPSGD, train_local_private
    from fedclinic.training.trainer import TrainConfig

    rng = np.random.default_rng(0)
    loaded = build(package_feature_model(num_features=5, labels=["a", "b", "c"]))
    with torch.no_grad():
        for p in loaded.module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    data = encode_features(rng.normal(size=(7, 5)).astype("float32"), rng.integers(0, 3, 7), loaded)
    (x,), y = data.batch(torch.arange(7), torch.device("cpu"))
    names = [n for n, _ in loaded.module.named_parameters()]
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    grads = [torch.autograd.grad(F.cross_entropy(loaded.module(x[i:i + 1]), y[i:i + 1]),
                                 list(loaded.module.parameters())) for i in range(7)]
    norms = [float(torch.sqrt(sum(g.square().sum() for g in gs))) for gs in grads]
    clip = sorted(norms)[3]
    train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=3, device="cpu"),
                        DPSGD(1e-9, clip, 1.0, 1), trainable=names)
    for k, (name, p) in enumerate(loaded.module.named_parameters()):
        want = before[name] - sum(gs[k] * min(1.0, clip / n) for gs, n in zip(grads, norms)) / 7
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=name)
