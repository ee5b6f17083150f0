"""fedclinic.training.eager_optimizers: torch's optimizers stepped without importing its compiler, bit for bit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedclinic.training import eager_optimizers
from fedclinic.training.optimizers import make_optimizer

ROOT = Path(__file__).resolve().parents[3]


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(7, 5, generator=gen), torch.randn(5, generator=gen)]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "self_adam"])
def test_the_eager_step_equals_torchs_step_bit_for_bit(name):
    torchs, ours = _params(1), _params(1)
    opt_t = make_optimizer(name, torchs, lr=0.05, weight_decay=0.01)
    opt_o = make_optimizer(name, ours, lr=0.05, weight_decay=0.01)
    for step in range(4):
        for p, q, g in zip(torchs, ours, _grads(step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt_t.step()
        eager_optimizers.step(opt_o)
        opt_t.zero_grad(set_to_none=True)
        opt_o.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(torchs, ours))
    assert not torch.equal(torchs[0], _params(1)[0])  # the steps moved the weights
    state_t, state_o = opt_t.state_dict()["state"], opt_o.state_dict()["state"]
    assert state_t.keys() == state_o.keys() and (bool(state_t) or name == "sgd")  # plain SGD keeps no state
    for k in state_t:
        assert state_t[k].keys() == state_o[k].keys()
        assert all(torch.equal(torch.as_tensor(state_t[k][f]), torch.as_tensor(state_o[k][f])) for f in state_t[k])


def test_an_optimizer_with_step_hooks_takes_torchs_own_step():
    params = _params(2)
    opt = make_optimizer("adamw", params, lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for p, g in zip(params, _grads(0)):
        p.grad = g
    eager_optimizers.step(opt)
    assert calls == ["pre", "post"]


def test_a_differentiable_optimizer_is_left_to_torch():
    assert eager_optimizers._plain_step(torch.optim.SGD(_params(3), lr=0.1, differentiable=True)) is None
    assert eager_optimizers._plain_step(torch.optim.SGD(_params(3), lr=0.1)) is not None


def test_training_our_own_models_in_a_fresh_process_never_imports_torchs_compiler():
    """The point of the module: a process that trains one of our models (the ordinary loop with AdamW and SGD, the
    fused step) leaves torch._dynamo unimported, where torch.optim alone imports it (1.3-2.4 CPU s per agent)."""
    code = textwrap.dedent("""
        import sys
        from fedclinic.training.trainer import TrainConfig, encode, train_local
        from tests.helpers.symptom_models import examples, model

        for arch, cfg in [("logreg", TrainConfig(optimizer="adamw", batch_size=8, device="cpu")),
                          ("lstm", TrainConfig(optimizer="sgd", learning_rate=0.1, batch_size=8, device="cpu")),
                          ("lstm", TrainConfig(optimizer="sgd", learning_rate=0.1, batch_size=8, device="cpu",
                                               step_in_backward=True, max_grad_norm=0.0))]:
            pkg, loaded = model(arch)
            result = train_local(loaded, encode(examples(24), loaded, max_length=16), cfg, trainable=list(pkg.tensors))
            assert result.steps == 3, result.steps
        print("DYNAMO", "torch._dynamo" in sys.modules)
        import torch.optim
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()  # the check itself can fail
        print("DYNAMO AFTER TORCH'S OWN STEP", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{ROOT / 'sdk'}:{ROOT}", "HF_HUB_OFFLINE": "1",
                              "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "DYNAMO False" in out.stdout and "DYNAMO AFTER TORCH'S OWN STEP True" in out.stdout, out.stdout
