"""Dynamic weighting by update magnitude (the IU-CXR report, CS59-2), with delta upload.

Both definitions of a site's "contribution" c_k are available, switchable with ``definition``:

``report`` (default): the report's Eqs. (its spec section 3.2), computed by the server from the deltas::

    c_k = sum over tensors i of ||d_k^i||_2          (Frobenius norm of each tensor's delta, summed)

``code``: what the report's notebook actually ran (spec section 3.3). Each site measures, on its own training
data, the full-pass gradient before and after local training and reports
``gradient_change_rate = mean_i ||g_i^after - g_i^before|| / (||g_i^before|| + 1e-7)`` (tasks with
``measure_gradient_change`` on; ``fedclinic.training.trainer.gradient_change_rate``). The server reads it from the
update's metrics: c_k is site-reported and cannot be checked.

Then, for every tensor i, over the sites that sent it::

    omega_k = c_k / (sum_j c_j + eps)               (eps = 1e-7, as the notebook)
    w^i <- w^i + eta * sum_k omega_k d_k^i

Sample counts are not used. The default is the report's definition because the server computes it from
what it receives: a site cannot claim a weight its update does not show. The incentive runs one way
(a larger change weighs more), so a diverging or noisy site gains influence. That is the paper's design,
kept here as written. It streams like FedAvg (c_k is a weight known once the update has been read), but it
needs each site's update (or its reported rate), so it cannot run on a securely aggregated sum.
"""

from __future__ import annotations

import math
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.strategies.fedavg import FedAvg, check_update
from fedclinic.strategies.tensorsource import TensorLike, squared_norm

DEFINITIONS = ("report", "code")
RATE_METRIC = "gradient_change_rate"


class DynamicWeighting(FedAvg):
    name: ClassVar[str] = "dynamic-weighting"
    needs_per_site_updates: ClassVar[bool] = True

    def __init__(self, server_lr: float = 1.0, definition: str = "report", eps: float = 1e-7) -> None:
        super().__init__(server_lr)
        if definition not in DEFINITIONS:
            raise ValueError(f"definition must be one of {DEFINITIONS}")
        if not eps > 0:
            raise ValueError("eps must be > 0")
        self.definition = definition
        self.eps = float(eps)
        self.contributions: dict[str, float] = {}

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        super().begin(global_tensors)
        self.contributions = {}

    def site_metrics(self) -> tuple[str, ...]:
        return (RATE_METRIC,) if self.definition == "code" else ()

    def partial_updates_problem(self) -> str:
        return ("dynamic-weighting weighs a site by the summed norms of all the tensors it sent, so sites sending "
                "different layers would be weighted by which layers they picked")

    def weight_for(self, num_samples: int, metrics: Mapping[str, float]) -> float:
        if self.definition == "report":
            return float(num_samples)  # unused: accept() measures the update itself
        rate = metrics.get(RATE_METRIC)
        if rate is None or not math.isfinite(rate) or rate < 0:
            raise IntegrityError(f"dynamic-weighting (definition 'code') needs the site's {RATE_METRIC} metric "
                                 f"(>= 0), got {rate!r}; the task must set measure_gradient_change = true")
        return float(rate)

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site)
        if self.definition == "report":
            c = sum(math.sqrt(squared_norm(delta, self._scratch)) for delta in update.values())
        else:
            c = float(weight)
        if not math.isfinite(c):
            raise IntegrityError(f"update from {site} has a non-finite magnitude")
        self._add(update, c, 1.0)
        self.contributions[site] = c

    def finalize(self) -> dict[str, np.ndarray]:
        for name in self._weight:
            self._weight[name] += self.eps  # omega_k = c_k / (sum c + eps)
        return super().finalize()
