"""Client-level differential privacy at the aggregator: DP-FedAvg with central Gaussian noise and, optionally,
adaptive clipping.

Each round, over the m updates accepted (McMahan et al., ICLR 2018, "DP-FedAvg")::

    clip(d_i)  = d_i * min(1, C / ||d_i||_2)                  every site's whole update, one L2 norm
    w         <- w + eta * ( sum_i clip(d_i) + N(0, (z_d C)^2 I) ) / m

Sites are weighted equally: a sample-count weight would let one site's contribution exceed C and break the
sensitivity bound. ``m`` is the number of updates accepted in the round (the noise is calibrated to one
site's contribution C of the sum, so the guarantee is about adding or removing one site's whole update).

Adaptive clipping (Andrew et al., NeurIPS 2021, "Differentially private learning with adaptive clipping"):
each site's update also yields the bit ``b_i = 1[||d_i|| <= C]``; the server releases
``b~ = (sum_i b_i + N(0, sigma_b^2)) / m`` and moves the clip norm geometrically towards the
``target_quantile`` gamma of the update norms::

    C <- C * exp(-clip_lr * (b~ - gamma))

When more than a gamma share of updates already fit (b~ > gamma) the clip norm **shrinks**; when fewer fit it
grows. (Flower's adaptive-clipping strategies apply the opposite sign; ``test_client_dp`` checks the direction.)
The count is a second Gaussian query on the same sites, so for an overall noise multiplier z the update noise
is ``z_d = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al., Thm. 1), with ``sigma_b = m / 20`` by default
(their recommendation), or ``count_noise``; this needs ``sigma_b > z / 2``. With the few sites of a
cross-silo federation ``m / 20`` is small, so set ``count_noise`` (e.g. to z) explicitly.

Accounting: every round is one Gaussian mechanism with multiplier z on the set of participating sites
(sampling rate 1: every enrolled site may take part), composed over rounds with the RDP accountant;
:meth:`ClientDP.epsilon` answers epsilon at ``delta`` after the rounds run so far. The state carried between
rounds (and across aggregator restarts) is the clip norm and the round count.

The noise -- of the update sum and of the clip count -- comes from fedclinic's CSPRNG: a
:class:`~fedclinic.strategies.secure_gaussian.SecureGaussian` (Marsaglia's polar method in float64 over a ChaCha20
keystream keyed from ``os.urandom``, rounded once to the float32 accumulators; see that module for the
floating-point attacks it answers and what remains) made afresh every round and never stored: whoever could
replay it could subtract it from the released model.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.strategies.dp_accounting import epsilon_of
from fedclinic.strategies.fedavg import FedAvg, check_update
from fedclinic.strategies.secure_gaussian import SecureGaussian
from fedclinic.strategies.tensorsource import TensorLike, squared_norm


def _noise_source() -> SecureGaussian:
    """A fresh CSPRNG-backed sampler per round, keyed from the OS (tests replace this function to replay noise)."""
    return SecureGaussian()


class ClientDP(FedAvg):
    name: ClassVar[str] = "dp-fedavg"
    needs_per_site_updates: ClassVar[bool] = True  # the server clips each update (central DP; see module doc)

    def __init__(self, server_lr: float = 1.0, clip_norm: float = 1.0, noise_multiplier: float = 1.0,
                 adaptive: float = 0.0, target_quantile: float = 0.5, clip_lr: float = 0.2,
                 count_noise: float = 0.0, delta: float = 1e-5) -> None:
        super().__init__(server_lr)
        if not clip_norm > 0:
            raise ValueError("clip_norm must be > 0")
        if not noise_multiplier > 0:
            raise ValueError("noise_multiplier must be > 0 (client-level DP without noise protects nothing)")
        if adaptive not in (0, 1, 0.0, 1.0, True, False):
            raise ValueError("adaptive must be 0 or 1")
        if not 0 < target_quantile < 1:
            raise ValueError("target_quantile must be in (0, 1)")
        if not clip_lr > 0:
            raise ValueError("clip_lr must be > 0")
        if count_noise < 0:
            raise ValueError("count_noise must be >= 0 (0 = m / 20)")
        if not 0 < delta < 1:
            raise ValueError("delta must be in (0, 1)")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.adaptive = bool(adaptive)
        self.target_quantile = float(target_quantile)
        self.clip_lr = float(clip_lr)
        self.count_noise = float(count_noise)
        self.delta = float(delta)
        self.rounds_done = 0
        self._unclipped = 0
        self._count = 0

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        super().begin(global_tensors)
        self._unclipped = 0
        self._count = 0

    def weight_for(self, num_samples: int, metrics: Mapping[str, float]) -> float:
        return 1.0  # equal weights: see the module docstring

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site, weight)
        norm = math.sqrt(sum(squared_norm(delta, self._scratch) for delta in update.values()))
        scale = min(1.0, self.clip_norm / norm) if norm > 0 else 1.0
        self._add(update, 1.0, scale)
        self._count += 1
        self._unclipped += int(norm <= self.clip_norm)

    def partial_updates_problem(self) -> str:
        return ("dp-fedavg divides every tensor by the number m of updates (its noise is calibrated to that sum), "
                "so a layer few sites sent would shrink towards zero")

    def count_sigma(self, m: int) -> float:
        return self.count_noise or m / 20.0

    def update_noise_multiplier(self, m: int) -> float:
        """z_d: the noise multiplier left for the update sum once the clip-count query has taken its share."""
        if not self.adaptive:
            return self.noise_multiplier
        sigma_b = self.count_sigma(m)
        rest = self.noise_multiplier ** -2 - (2.0 * sigma_b) ** -2
        if rest <= 0:
            raise ValueError(f"adaptive clipping needs count noise sigma_b > noise_multiplier / 2 = "
                             f"{self.noise_multiplier / 2:.3g}, got {sigma_b:.3g} (m / 20 with {m} sites); "
                             "set count_noise explicitly")
        return rest ** -0.5

    def finalize(self) -> dict[str, np.ndarray]:
        m = self._count
        if m == 0:
            return super().finalize()
        noise = _noise_source()
        std = self.update_noise_multiplier(m) * self.clip_norm
        for name in self._acc.names():
            acc = self._acc.load(name, int(np.prod(self._global[name].shape, dtype=np.int64)))
            acc += noise.sample(acc.shape, std, acc.dtype)
            self._acc.store(name, acc)
            self._weight[name] = float(m)  # the mean over the m accepted updates, whoever sent the tensor
        if self.adaptive:
            noisy_share = (self._unclipped + float(noise.sample((), self.count_sigma(m), np.float64))) / m
            self.clip_norm *= math.exp(-self.clip_lr * (noisy_share - self.target_quantile))
        self.rounds_done += 1
        return super().finalize()

    def epsilon(self, rounds: int | None = None) -> float:
        """Epsilon at :attr:`delta` after ``rounds`` rounds (default: the rounds run so far), RDP accountant."""
        return epsilon_of([(self.noise_multiplier, 1.0, self.rounds_done if rounds is None else rounds)], self.delta)

    def state(self) -> dict[str, np.ndarray]:
        return {"clip_norm": np.array([self.clip_norm], np.float64),
                "rounds_done": np.array([self.rounds_done], np.int64)}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        if not state:
            return
        unknown = set(state) - {"clip_norm", "rounds_done"}
        if unknown:
            raise ValueError(f"dp-fedavg state has unknown entries {sorted(unknown)}")
        self.clip_norm = float(np.asarray(state["clip_norm"]).reshape(-1)[0])
        self.rounds_done = int(np.asarray(state["rounds_done"]).reshape(-1)[0])
