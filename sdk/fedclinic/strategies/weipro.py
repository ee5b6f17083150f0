"""WeiPro (CancersQA): a loss-weighted reference direction, then weights from each update's projection on it.

Per round, over the participating sites k with deltas d_k = theta_k - theta (CancersQA spec section 5.5)::

    raw_k = n_k * phi_k * L_k                       (reference weights, eq. 5 with the loss in place of sigma)
    rho_k = raw_k / sum_j raw_j
    R     = sum_k rho_k d_k                         (the reference vector theta_ref - theta)
    p_k   = <d_k, R> / ||R||                        (eq. 9, signed scalar projection)
    z_k   = |p_k|   ("abs", the paper's "projection's length")   or   max(p_k, 0) + eps   ("relu")
    alpha_k = z_k^lambda / sum_j z_j^lambda         (eq. 10; lambda = 1 in the paper)
    theta <- theta + sum_k alpha_k d_k              (the "delta" reading of the final update)

If ||R|| is ~0 (a degenerate reference), alpha = rho.

Where the paper allows several readings, the default follows the spec's reconciled choice, for these reasons:

- ``reference = "eq5_loss"`` (default): the experiments section says loss, data distribution, hardware
  state and the rounds joined "jointly determine the model coefficients". That is eq. 5 with the loss in
  place of sigma. ``"alg1_loss"`` is Algorithm 1 (raw_k = L_k only). Eq. 5's sigma (a generation pass rate
  on validation data) is not offered: it needs the question-answering family's generation at the site.
- ``n_mode = "none"`` (default): the paper's n_k is "the number of GPUs in the k-th node". A fedclinic agent
  trains on one device, so that factor is 1 at every site; ``"samples"`` uses the sample count instead.
- ``loss_reduction = "sum"`` (default): Algorithm 1 sums the batch losses (L_k = mean batch loss x
  optimizer steps, from the site's ``train_loss`` and ``steps`` metrics); ``"mean"`` uses ``train_loss``.
- ``z = "abs"`` (default): the paper's stated alternative to its unspecified "linear transformer block".
  A site whose update points against the reference still gets weight; ``"relu"`` gives it ~0.
- Only the "delta" reading of the final update exists. The literal theta_0 + sum alpha_k theta_k would
  roughly double every weight.

phi_k (rounds site k has joined, this one included) is strategy state kept between rounds. The strategy
needs each site's update three times (reference, projections, result), so it keeps references to the
updates (spill files at the aggregator) and needs every site to send the same tensors. It cannot run on a
securely aggregated sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.strategies.base import Strategy
from fedclinic.strategies.fedavg import _BLOCK, check_update, weighted_add
from fedclinic.strategies.tensorsource import TensorLike, blocks

REFERENCES = ("eq5_loss", "alg1_loss")
N_MODES = ("none", "samples")
LOSS_REDUCTIONS = ("sum", "mean")
Z_MODES = ("abs", "relu")
_EPS = 1e-12


class WeiPro(Strategy):
    name: ClassVar[str] = "weipro"
    needs_per_site_updates: ClassVar[bool] = True

    def __init__(self, reference: str = "eq5_loss", n_mode: str = "none", loss_reduction: str = "sum",
                 z: str = "abs", lam: float = 1.0) -> None:
        for value, allowed, what in ((reference, REFERENCES, "reference"), (n_mode, N_MODES, "n_mode"),
                                     (loss_reduction, LOSS_REDUCTIONS, "loss_reduction"), (z, Z_MODES, "z")):
            if value not in allowed:
                raise ValueError(f"{what} must be one of {allowed}")
        if not (math.isfinite(lam) and lam > 0):
            raise ValueError("lam must be a finite number > 0")
        self.reference, self.n_mode, self.loss_reduction, self.z, self.lam = reference, n_mode, loss_reduction, z, lam
        self._participation: dict[str, int] = {}
        self._global: Mapping[str, TensorLike] = {}
        self._updates: list[tuple[str, Mapping[str, TensorLike], float]] = []
        self._scratch = np.empty(_BLOCK, dtype=np.float32)
        self.alpha: dict[str, float] = {}

    # state: phi per site ---------------------------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        return {f"phi/{site}": np.array([n], dtype=np.float32) for site, n in self._participation.items()}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self._participation = {key.split("/", 1)[1]: int(np.asarray(v).reshape(-1)[0]) for key, v in state.items()}

    def partial_updates_problem(self) -> str:
        return "weipro projects whole updates on a reference direction, which needs every site to send the same tensors"

    def site_metrics(self) -> tuple[str, ...]:
        return ("train_loss", "steps") if self.loss_reduction == "sum" else ("train_loss",)

    def weight_for(self, num_samples: int, metrics: Mapping[str, float]) -> float:
        """n_k * L_k (the factors a site reports); phi_k is applied in :meth:`accept`."""
        loss = metrics.get("train_loss")
        if loss is None or not math.isfinite(loss) or loss < 0:
            raise IntegrityError(f"weipro needs the site's train_loss metric (>= 0), got {loss!r}")
        if self.loss_reduction == "sum":
            steps = metrics.get("steps")
            if steps is None or not steps >= 1:
                raise IntegrityError(f"weipro with loss_reduction 'sum' needs the site's steps metric, got {steps!r}")
            loss *= steps
        if self.reference == "eq5_loss" and self.n_mode == "samples":
            loss *= num_samples
        return float(loss)

    # the round -------------------------------------------------------------------------------------------
    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        self._global = global_tensors
        self._updates = []
        self.alpha = {}

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site, weight if weight > 0 else 1.0)
        if not math.isfinite(weight) or weight < 0:
            raise IntegrityError(f"update from {site} has an invalid reference weight {weight}")
        if self._updates and set(update) != set(self._updates[0][1]):
            raise IntegrityError(f"weipro needs every site to send the same tensors; {site} differs")
        if any(s == site for s, _, _ in self._updates):
            raise IntegrityError(f"{site} already sent an update this round")
        phi = self._participation.get(site, 0) + 1 if self.reference == "eq5_loss" else 1
        self._updates.append((site, dict(update), float(weight) * phi))

    def _dot(self, x: TensorLike, dense: np.ndarray) -> float:
        total = 0.0
        for start, block in blocks(x, self._scratch):
            total += float(np.dot(block, dense[start:start + block.size]))
        return total

    def finalize(self) -> dict[str, np.ndarray]:
        if not self._updates:
            return {}
        names = list(self._updates[0][1])
        raw = np.array([w for _, _, w in self._updates], dtype=np.float64)
        rho = raw / raw.sum() if raw.sum() > 0 else np.full(len(raw), 1.0 / len(raw))
        size = {n: int(np.prod(self._global[n].shape, dtype=np.int64)) for n in names}
        reference = {n: np.zeros(size[n], np.float32) for n in names}
        for (_, update, _), r in zip(self._updates, rho):           # pass 1: R = sum rho_k d_k
            for n in names:
                weighted_add(reference[n], update[n], float(r), self._scratch)
        norm = math.sqrt(sum(float(np.dot(v, v)) for v in reference.values()))
        if norm < _EPS:
            alpha = rho
        else:                                                        # pass 2: projections p_k
            p = np.array([sum(self._dot(update[n], reference[n]) for n in names) / norm
                          for _, update, _ in self._updates])
            z = np.abs(p) if self.z == "abs" else np.maximum(p, 0.0) + _EPS
            zl = z ** self.lam
            alpha = zl / zl.sum() if zl.sum() > 0 else rho
        out: dict[str, np.ndarray] = {}
        for n in names:                                              # pass 3: theta + sum alpha_k d_k
            acc = reference[n]
            acc[:] = 0.0
            for (_, update, _), a in zip(self._updates, alpha):
                weighted_add(acc, update[n], float(a), self._scratch)
            for start, block in blocks(self._global[n], self._scratch):
                acc[start:start + block.size] += block
            out[n] = acc.reshape(self._global[n].shape).astype(self._global[n].dtype, copy=False)
        self.alpha = {site: float(a) for (site, _, _), a in zip(self._updates, alpha)}
        for site, _, _ in self._updates:
            self._participation[site] = self._participation.get(site, 0) + 1
        self._updates = []
        return out
