"""Robust aggregation: strategies that bound the influence of any single site.

Coordinate-wise median and trimmed mean (Yin et al., ICML 2018) need every site's update at once. They
keep references to the updates, which the aggregator has on disk anyway until the round closes (spill
files). At finalize they read all of them block by block in lockstep, so memory is
O(sites × block + model) instead of O(sites × model). The simulator passes in-memory arrays, which works
the same way. These strategies look at individual updates, so they cannot run under secure aggregation.

Per coordinate j, over the sites S that sent the tensor (weights are not used: robustness must not depend
on a site-reported sample count)::

    median:        Delta_j = median_{i in S} d_{i,j}
    trimmed mean:  Delta_j = mean of the values left after dropping the k = floor(beta * |S|) largest and
                   the k smallest of {d_{i,j}}
    x_j <- x_j + eta * Delta_j

Norm bounding (Sun et al. 2019, "Can you really backdoor FL?") streams like FedAvg. Each site's whole
update is scaled by min(1, C / ||d_i||_2) before the sample-weighted mean, so one large update cannot
dominate the sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.strategies.base import Strategy
from fedclinic.strategies.fedavg import _BLOCK, FedAvg, check_update
from fedclinic.strategies.tensorsource import TensorLike, blocks, squared_norm


class _CoordinateWise(Strategy):
    needs_per_site_updates: ClassVar[bool] = True
    _BLOCK_ELEMS: ClassVar[int] = _BLOCK // 4  # smaller blocks: one buffer per site is held at a time

    def __init__(self, server_lr: float = 1.0) -> None:
        self.server_lr = float(server_lr)
        self._global: Mapping[str, TensorLike] = {}
        self._updates: list[Mapping[str, TensorLike]] = []

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        self._global = global_tensors
        self._updates = []

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site)
        self._updates.append(dict(update))

    def partial_updates_problem(self) -> str:
        return ""  # per coordinate over the sites that sent the tensor

    def _combine(self, stack: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def finalize(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, ref in self._global.items():
            parts = [u[name] for u in self._updates if name in u]
            if not parts:
                continue
            result = np.empty(int(np.prod(ref.shape, dtype=np.int64)), dtype=np.float32)
            scratch = [np.empty(self._BLOCK_ELEMS, np.float32) for _ in parts]
            for pieces in zip(*(blocks(x, s) for x, s in zip(parts, scratch))):
                start = pieces[0][0]
                stack = np.stack([b for _, b in pieces])
                result[start:start + stack.shape[1]] = self._combine(stack)
            result *= np.float32(self.server_lr)
            own = np.empty(self._BLOCK_ELEMS, np.float32)
            for start, block in blocks(ref, own):
                result[start:start + block.size] += block
            out[name] = result.reshape(ref.shape)
        self._updates = []
        return out


class Median(_CoordinateWise):
    name: ClassVar[str] = "median"

    def _combine(self, stack: np.ndarray) -> np.ndarray:
        return np.median(stack, axis=0)


class TrimmedMean(_CoordinateWise):
    name: ClassVar[str] = "trimmed-mean"

    def __init__(self, server_lr: float = 1.0, beta: float = 0.2) -> None:
        super().__init__(server_lr)
        if not 0 <= beta < 0.5:
            raise ValueError("beta must be in [0, 0.5)")
        self.beta = float(beta)

    def _combine(self, stack: np.ndarray) -> np.ndarray:
        k = math.floor(self.beta * stack.shape[0])
        if k == 0:
            return stack.mean(axis=0)
        return np.sort(stack, axis=0)[k:stack.shape[0] - k].mean(axis=0)


class NormBounded(FedAvg):
    name: ClassVar[str] = "norm-bounded"
    needs_per_site_updates: ClassVar[bool] = True  # the server must see each update's norm

    def __init__(self, server_lr: float = 1.0, max_norm: float = 1.0) -> None:
        super().__init__(server_lr)
        if not max_norm > 0:
            raise ValueError("max_norm must be > 0")
        self.max_norm = float(max_norm)

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site, weight)
        sq = sum(squared_norm(delta, self._scratch) for delta in update.values())  # first pass: the L2 norm
        self._add(update, float(weight), min(1.0, self.max_norm / math.sqrt(sq)) if sq > 0 else 1.0)


class MultiKrum(_CoordinateWise):
    """Multi-Krum (Blanchard et al., NeurIPS 2017): average the m updates closest to their neighbours.

    With n updates and at most f Byzantine sites, each update i gets the score
    ``s_i = sum of ||d_i - d_j||^2 over its n - f - 2 nearest other updates``; the m lowest-scoring updates
    are averaged, weighted by sample count (m = 1 is Krum). Distances come from the Gram matrix
    ``G = D D^T``, accumulated block by block over every tensor (``||d_i - d_j||^2 = G_ii + G_jj - 2 G_ij``),
    so memory stays O(n^2 + n x block). Every site must send the same tensors.
    """

    name: ClassVar[str] = "multi-krum"

    def __init__(self, server_lr: float = 1.0, byzantine: int = 1, keep: int = 0) -> None:
        super().__init__(server_lr)
        if byzantine < 0:
            raise ValueError("byzantine must be >= 0")
        self.byzantine = int(byzantine)
        self.keep = int(keep)  # 0 = n - f
        self._weights: list[float] = []
        self.selected: list[int] = []

    def min_updates(self) -> int:
        return 2 * self.byzantine + 3

    def partial_updates_problem(self) -> str:
        return "multi-krum compares whole updates by their distances, which needs every site to send the same tensors"

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        super().begin(global_tensors)
        self._weights = []

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        if self._updates and set(update) != set(self._updates[0]):
            raise IntegrityError(f"multi-krum needs every site to send the same tensors; {site} differs")
        super().accept(update, weight, site=site)
        self._weights.append(float(weight))

    def finalize(self) -> dict[str, np.ndarray]:
        n, f = len(self._updates), self.byzantine
        if n < 2 * f + 3:
            raise IntegrityError(f"multi-krum with byzantine={f} needs at least {2 * f + 3} updates, got {n}; "
                                 "lower 'byzantine' or raise min_sites")
        gram = np.zeros((n, n), dtype=np.float64)
        for name in self._updates[0]:
            scratch = [np.empty(self._BLOCK_ELEMS, np.float32) for _ in range(n)]
            for pieces in zip(*(blocks(u[name], s) for u, s in zip(self._updates, scratch))):
                stack = np.stack([b for _, b in pieces]).astype(np.float64)
                gram += stack @ stack.T
        sq = np.diag(gram)
        dist = np.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)
        closest = n - f - 2
        scores = [np.sort(np.delete(dist[i], i))[:closest].sum() for i in range(n)]
        m = self.keep or n - f
        self.selected = sorted(int(i) for i in np.argsort(scores, kind="stable")[:m])
        weights = np.array([self._weights[i] for i in self.selected])
        self._combine_weights = weights / weights.sum()
        self._updates = [self._updates[i] for i in self.selected]
        return super().finalize()

    def _combine(self, stack: np.ndarray) -> np.ndarray:
        return np.tensordot(self._combine_weights.astype(np.float32), stack, axes=1)
