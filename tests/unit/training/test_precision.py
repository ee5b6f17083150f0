"""fedclinic.training.precision: the autocast dtype choice (``TrainConfig.autocast_dtype``), validated, and what it
does on the CPU (bf16 and fp16 autocast run here; the CUDA rows run in bench/gpu_check.py on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedclinic.errors import ConfigError
from fedclinic.models import module_tensors
from fedclinic.proto import task_pb2
from fedclinic.training.precision import AUTOCAST_DTYPES, autocast_for
from fedclinic.training.trainer import TrainConfig, encode, train_local

from tests.helpers.symptom_models import examples, model


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_autocast_dtype_is_validated_with_the_choices():
    assert TrainConfig().autocast_dtype == "auto"
    assert TrainConfig.from_proto(task_pb2.TrainingConfig(mixed_precision=True)).autocast_dtype == "auto"
    for ok in AUTOCAST_DTYPES:
        TrainConfig(mixed_precision=True, autocast_dtype=ok)
    for bad in ("float16", "fp8", "", None, 16):
        with pytest.raises(ConfigError, match=r"autocast_dtype must be one of 'auto', 'bf16', 'fp16', got "):
            TrainConfig(mixed_precision=True, autocast_dtype=bad)
    with pytest.raises(ConfigError, match="autocast_dtype must be one of"):
        autocast_for(torch.device("cpu"), True, "half")


def test_cpu_autocast_contexts():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    cpu = torch.device("cpu")
    for enabled, dtype in ((False, "bf16"), (False, "fp16"), (True, "auto")):  # "auto" on the CPU: float32, as before
        ctx, scaler = autocast_for(cpu, enabled, dtype)
        with ctx():
            assert lin(x).dtype == torch.float32
        assert scaler is None
    ctx, scaler = autocast_for(cpu, True, "bf16")
    with ctx():
        assert lin(x).dtype == torch.bfloat16
    assert scaler is None
    ctx, scaler = autocast_for(cpu, True, "fp16")
    with ctx():
        assert lin(x).dtype == torch.float16
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled()


def _train(mixed: bool, dtype: str) -> dict[str, np.ndarray]:
    pkg, loaded = model("transformer")
    data = encode(examples(16), loaded)
    result = train_local(loaded, data, TrainConfig(learning_rate=1e-2, batch_size=8, mixed_precision=mixed,
                                                   autocast_dtype=dtype, device="cpu", seed=3),
                         trainable=list(pkg.tensors))
    assert result.steps == 2 and np.isfinite(result.loss)
    return module_tensors(loaded.module)


def test_train_local_runs_in_the_chosen_dtype_on_cpu():
    fp32 = _train(False, "bf16")
    auto = _train(True, "auto")
    bf16 = _train(True, "bf16")
    fp16 = _train(True, "fp16")
    assert all(np.array_equal(fp32[k], auto[k]) for k in fp32)  # default behaviour unchanged on the CPU
    for low in (bf16, fp16):
        assert all(v.dtype == np.float32 for v in low.values())  # parameters stay float32
        assert any(not np.array_equal(fp32[k], low[k]) for k in fp32)  # the matmuls ran in the lower precision
        # ... and the result is still close to the float32 round's
        assert max(float(np.max(np.abs(fp32[k] - low[k]))) for k in fp32) < 0.05
    assert any(not np.array_equal(bf16[k], fp16[k]) for k in bf16)
