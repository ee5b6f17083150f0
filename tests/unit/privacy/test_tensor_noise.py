"""DP-SGD's randomness comes from the CSPRNG: TensorNoise draws SecureGaussian samples as tensors, both clipping
paths (ghost and Opacus' hooks, through SecureDPOptimizer) add exactly that stream, and the Poisson sampler is a
SecureRandom keystream; a test's ``entropy`` replays all of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedclinic.privacy.dp_sgd import DPSGD, train_local_private
from fedclinic.privacy.secure_dp_optimizer import SecureDPOptimizer
from fedclinic.privacy.tensor_noise import SecureGaussian, SecureRandom, TensorNoise, replay_key
from fedclinic.training.trainer import TrainConfig, encode, select_tensors
from tests.helpers.symptom_models import examples, model


def test_tensors_are_the_secure_gaussian_samples_in_the_reference_dtype():
    ref32, ref64 = torch.zeros(3, 5), torch.zeros(4, dtype=torch.float64)
    got = TensorNoise.replay(5, "t")
    a, b = got.like(ref32, 2.0), got.like(ref64, 0.5)
    want = SecureGaussian.replay(5, "t")
    assert a.dtype == torch.float32 and a.shape == (3, 5) and b.dtype == torch.float64
    np.testing.assert_array_equal(a.numpy(), want.sample((3, 5), 2.0, np.float32))
    np.testing.assert_array_equal(b.numpy(), want.sample(4, 0.5, np.float64))
    assert not torch.equal(TensorNoise().like(ref32, 1.0), TensorNoise().like(ref32, 1.0))  # fresh keys
    for bad in (torch.bfloat16, torch.int64):
        with pytest.raises(ValueError, match="float16/32/64"):
            got.tensor((2,), 1.0, dtype=bad)
    with pytest.raises(TypeError, match="generator or secure_mode"):
        SecureDPOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), noise=got,
                          noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1, generator=None)


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
def test_both_clipping_paths_add_the_replayed_csprng_noise(mode):
    """sigma C = 1 with C = 1e-6: the clipped sum is at most n C, so one SGD step at lr 1 moves each weight by
    -noise / n to within 1e-6, and that noise must be the keyed TensorNoise stream, tensor by tensor."""
    _, loaded = model("transformer")
    data = encode(examples(6), loaded, max_length=16)
    names = select_tensors(loaded.module.state_dict())
    before = {n: p.detach().clone() for n, p in loaded.module.named_parameters()}
    train_local_private(loaded, data, TrainConfig(optimizer="sgd", learning_rate=1.0, batch_size=6),
                        DPSGD(1e6, 1e-6, 1.0, 1), trainable=names, mode=mode, entropy=99)
    noise = TensorNoise.replay(99, "dp-sgd noise")
    for name, p in loaded.module.named_parameters():
        if name in names:
            want = before[name] - noise.like(p, 1.0) / 6
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=2e-6, msg=name)


def test_the_poisson_sample_is_the_replayed_keystream():
    _, loaded = model("transformer")
    inner = encode(examples(20), loaded, max_length=16)
    seen: list[list[int]] = []

    class Recording:
        multi_label, num_labels = inner.multi_label, inner.num_labels

        def __len__(self):
            return len(inner)

        def batch(self, idx, device):
            seen.append(idx.tolist())
            return inner.batch(idx, device)

    train_local_private(loaded, Recording(), TrainConfig(optimizer="sgd", learning_rate=0.1, batch_size=32),
                        DPSGD(1.0, 1.0, 0.5, 4), trainable=select_tensors(loaded.module.state_dict()),
                        mode="ghost", entropy=7)
    sampler = SecureRandom(replay_key(7, "dp-sgd sampler"))
    want = [np.flatnonzero(sampler.uniform(20) < 0.5).tolist() for _ in range(4)]
    assert seen == [w for w in want if w]
