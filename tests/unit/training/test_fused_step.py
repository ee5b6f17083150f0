"""fedclinic.training.fused_step: the optimizer step fused into the backward pass (TrainConfig.step_in_backward).

It must give the ordinary step's model (float tolerance), refuse the settings it cannot honour with a sentence
that names them, travel in the task proto, and keep fewer gradients alive: a child process's peak resident set
during training is measured with both steps (Linux ``VmHWM`` after ``clear_refs``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedclinic.errors import ConfigError
from fedclinic.models import module_tensors
from fedclinic.proto import task_pb2
from fedclinic.spec.task import Task
from fedclinic.training.fused_step import fused_conflicts
from fedclinic.training.trainer import TrainConfig, encode, train_local

from tests.helpers.symptom_models import examples, model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _trained(fused: bool, optimizer: str, lr: float, weight_decay: float = 0.0):
    pkg, loaded = model("transformer")
    data = encode(examples(40), loaded)
    res = train_local(loaded, data, TrainConfig(optimizer=optimizer, learning_rate=lr, local_epochs=2, batch_size=8,
                                                weight_decay=weight_decay, max_grad_norm=0.0, seed=3,
                                                step_in_backward=fused, device="cpu"),
                      trainable=list(pkg.tensors))
    assert all(p.grad is None for p in loaded.module.parameters())
    return res, module_tensors(loaded.module), {k: v.copy() for k, v in pkg.tensors.items()}


@pytest.mark.parametrize("optimizer,lr,wd", [("sgd", 0.3, 0.0), ("sgd", 0.3, 0.01), ("adamw", 0.01, 0.01),
                                              ("self_adam", 0.01, 0.0)])
def test_the_fused_step_gives_the_ordinary_steps_model(optimizer, lr, wd):
    ordinary, want, start = _trained(False, optimizer, lr, wd)
    fused, got, _ = _trained(True, optimizer, lr, wd)
    assert fused.steps == ordinary.steps == 10  # 40 rows, batches of 8, two epochs
    assert fused.loss == pytest.approx(ordinary.loss, rel=1e-5)
    moved = 0
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=1e-6, err_msg=name)
        moved += not np.array_equal(w, start[name])
    assert moved >= len(want) - 2  # every trained tensor changed (a position/type row may see no gradient)


def test_conflicting_settings_are_refused_with_every_conflict_named():
    with pytest.raises(ConfigError, match=r"step_in_backward .* cannot be combined with max_grad_norm = 1 \(set 0"):
        TrainConfig(step_in_backward=True, optimizer="sgd")
    with pytest.raises(ConfigError) as err:
        TrainConfig(step_in_backward=True, max_grad_norm=0.5, proximal_mu=0.1, optimizer_state="keep")
    assert all(s in str(err.value) for s in ("max_grad_norm = 0.5", "proximal_mu = 0.1", 'optimizer_state = "keep"'))
    TrainConfig(step_in_backward=True, max_grad_norm=0.0)  # what it needs
    with pytest.raises(ConfigError, match=r"several devices.*fp16 mixed precision"):
        fused_conflicts(data_parallel=True, loss_scaling=True)
    fused_conflicts(data_parallel=False, loss_scaling=False)


def test_the_setting_travels_in_the_task_and_is_checked_there():
    base = dict(name="t", dataset="d", labels=["a", "b"], optimizer="sgd")
    with pytest.raises(ConfigError, match=r"step_in_backward .* max_grad_norm = 1"):
        Task(**base, step_in_backward=True).validate()
    with pytest.raises(ConfigError, match=r'privacy level = "sample"'):
        Task(**base, step_in_backward=True, max_grad_norm=0.0,
             privacy={"level": "sample", "noise_multiplier": 1.0, "target_delta": 1e-5, "max_grad_norm": 1.0}
             ).validate()
    msg = task_pb2.TrainingConfig.FromString(
        task_pb2.TrainingConfig(step_in_backward=True, max_grad_norm=0.0).SerializeToString())
    assert TrainConfig.from_proto(msg).step_in_backward is True
    assert TrainConfig.from_proto(task_pb2.TrainingConfig()).step_in_backward is False


# A child process: one BERT of 8 layers (~29 M parameters, ~115 MB; its largest tensor 4 MB), glibc's mmap threshold
# pinned as the agent pins it. Its peak resident set over a few SGD steps, above the resident set at their start.
_CHILD = r"""
import json, sys
from pathlib import Path
from fedclinic.runtime.heap_trim import fix_mmap_threshold
fix_mmap_threshold()
from fedclinic.training.trainer import TrainConfig, encode, train_local
from tests.helpers.symptom_models import examples, model

def status_kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

out = {}
for fused in (True, False):  # the fused step first: what it leaves in the heap cannot lower the ordinary peak
    pkg, loaded = model("transformer", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                        intermediate_size=2048)
    data = encode(examples(16), loaded)
    names = list(pkg.tensors)
    del pkg
    Path("/proc/self/clear_refs").write_text("5")
    start = status_kb("VmRSS")
    train_local(loaded, data, TrainConfig(optimizer="sgd", learning_rate=0.01, batch_size=4, max_steps=2,
                                          max_grad_norm=0.0, step_in_backward=fused, device="cpu"), trainable=names)
    out["fused" if fused else "ordinary"] = (status_kb("VmHWM") - start) * 1024
    out["grad_bytes"] = sum(p.numel() * 4 for p in loaded.module.parameters())
    del loaded
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak reset")
def test_the_fused_step_keeps_the_gradients_out_of_the_peak():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "sdk"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    grads = got["grad_bytes"]
    assert grads > 100e6
    # the ordinary step holds every gradient at once (plus activations), the fused step a few tensors' at most; the
    # heap the first run freed lowers the second's growth a little, hence half the gradients, not all
    assert got["ordinary"] - got["fused"] >= 0.5 * grads, got
