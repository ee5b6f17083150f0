"""FedAtt: attention-weighted aggregation (Ji et al. 2019), as FLCMC Eqs. 11-14 use it.

For each group G of tensors (each tensor on its own by default; the whole model as one group with
``granularity="whole_model"``), over the sites k of the round with deltas d_k = theta_k - theta_t::

    s_k      = ||d_k[G]||                      (Frobenius/Euclidean; "spectral" = largest singular value)
    alpha_k  = exp(s_k / T) / sum_j exp(s_j / T)
    theta_{t+1}[G] = theta_t[G] + lambda * sum_k alpha_k d_k[G]

This is Eq. 14, theta_t - lambda * sum_k alpha_k (theta_t - theta_k), written with deltas. The softmax is
over *distances*, as the paper and the FedAtt reference code have it: the site farthest from the server
gets the largest weight. The paper calls alpha a similarity, but we implement the equations as written,
not that word. Sample counts are not used (the ``weight`` given to ``accept`` is ignored). lambda > 1
extrapolates past the attention-weighted mean and is allowed unclipped (FLCMC tunes lambda = 4 and 9).
The FedAtt code's optional ``dp * N(0, I)`` server noise is not part of this strategy: client-level DP is
a separate, accounted mechanism.

Streaming: the softmax is computed online. Per tensor we keep the running maximum score M, the
denominator Z = sum_k exp(s_k/T - M) and the accumulator A = sum_k exp(s_k/T - M) d_k. A new maximum
rescales A and Z by exp(M_old - M_new) <= 1, so one pass over each update suffices, memory is
O(model), and no exponent overflows. Each update is read twice: once for its norms, once to fold it.
The strategy needs individual updates (their norms), so it cannot run on a securely aggregated sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.strategies.base import Strategy
from fedclinic.strategies.fedavg import _BLOCK, check_update, weighted_add
from fedclinic.strategies.tensorsource import FileTensor, TensorLike, blocks, squared_norm

GRANULARITIES = ("per_layer", "whole_model")
NORMS = ("frobenius", "spectral")


class FedAtt(Strategy):
    name: ClassVar[str] = "fedatt"
    needs_per_site_updates: ClassVar[bool] = True

    def __init__(self, server_lr: float = 1.2, temperature: float = 1.0, granularity: str = "per_layer",
                 norm: str = "frobenius") -> None:
        if not (math.isfinite(server_lr) and server_lr > 0):
            raise ValueError("server_lr (the step size lambda) must be a finite number > 0")
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError("temperature must be a finite number > 0")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}")
        if norm == "spectral" and granularity == "whole_model":
            raise ValueError("the spectral norm is defined per matrix; use it with granularity='per_layer'")
        self.server_lr = float(server_lr)
        self.temperature = float(temperature)
        self.granularity = granularity
        self.norm = norm
        self._global: Mapping[str, TensorLike] = {}
        self._acc: dict[str, np.ndarray] = {}
        self._max: dict[str, float] = {}
        self._denominator: dict[str, float] = {}
        self._scratch = np.empty(_BLOCK, dtype=np.float32)
        self._scores: dict[str, dict[str, float]] = {}

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        self._global = global_tensors
        self._acc, self._max, self._denominator, self._scores = {}, {}, {}, {}

    def partial_updates_problem(self) -> str:
        if self.granularity == "per_layer":
            return ""  # the softmax of each tensor runs over the sites that sent it
        return ("fedatt with granularity 'whole_model' scores a site by the norm of everything it sent, so sites "
                "sending different layers are not comparable (use granularity 'per_layer')")

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site)
        scores = self._site_scores(update)
        for name, delta in update.items():
            s = scores[name]
            acc = self._acc.get(name)
            if acc is None:
                acc = self._acc[name] = np.zeros(int(np.prod(self._global[name].shape, dtype=np.int64)), np.float32)
                self._max[name], self._denominator[name] = s, 0.0
            elif s > self._max[name]:
                rescale = math.exp(self._max[name] - s)
                acc *= np.float32(rescale)
                self._denominator[name] *= rescale
                self._max[name] = s
            w = math.exp(s - self._max[name])
            self._denominator[name] += w
            weighted_add(acc, delta, w, self._scratch)
        self._scores[site] = scores

    def _site_scores(self, update: Mapping[str, TensorLike]) -> dict[str, float]:
        """s_k / T for every tensor of the update (the same value for all of them with whole_model)."""
        norms = {name: self._distance(delta) for name, delta in update.items()}
        if self.granularity == "whole_model":
            total = math.sqrt(sum(v * v for v in norms.values()))
            norms = dict.fromkeys(norms, total)
        return {name: v / self.temperature for name, v in norms.items()}

    def _distance(self, delta: TensorLike) -> float:
        if self.norm == "spectral" and len(delta.shape) >= 2:
            full = delta.read() if isinstance(delta, FileTensor) else np.asarray(delta)
            return float(np.linalg.norm(full.reshape(full.shape[0], -1).astype(np.float64), ord=2))
        return math.sqrt(squared_norm(delta, self._scratch))

    def weights(self) -> dict[str, dict[str, float]]:
        """alpha_k per site and tensor for the updates accepted so far this round (for logs and tests)."""
        out: dict[str, dict[str, float]] = {}
        for site, scores in self._scores.items():
            out[site] = {name: math.exp(s - self._max[name]) / self._denominator[name] for name, s in scores.items()}
        return out

    def finalize(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, acc in self._acc.items():
            ref = self._global[name]
            acc *= np.float32(self.server_lr / self._denominator[name])
            for start, block in blocks(ref, self._scratch):
                acc[start:start + block.size] += block
            out[name] = acc.reshape(ref.shape).astype(ref.dtype, copy=False)
        self._acc = {}
        return out
