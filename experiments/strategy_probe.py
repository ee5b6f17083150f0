"""A recording wrapper around a real aggregation strategy, for experiment scripts that run the simulator.

:func:`fedclinic.federation.simulate.simulate` builds its strategy by name (``fedclinic.strategies.make_strategy``) and
returns only the global model's metrics. The reproduction studies also need what happened *inside* a round:
each site's effective aggregation weight and, for the IU-CXR protocol, each client model after local training
(before aggregation). :class:`RecordingStrategy` delegates every call to the real strategy unchanged and records
that on the side; :func:`registered` makes it available to ``simulate`` under a temporary name.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

import numpy as np


class RecordingStrategy:
    """Delegates to ``inner``; per round records ``omega`` (site -> share of the aggregate) and, with ``on_update``,
    ``clients`` (site -> whatever ``on_update(site, local_tensors, update)`` returns, called before the update is
    folded; ``local_tensors`` = the round's global tensors + the site's delta ``update``, i.e. the client model).

    The share is the strategy's own per-site coefficient where it exposes one (WeiPro's ``alpha``, dynamic
    weighting's ``contributions`` c_k), else the weight ``accept`` was given (FedAvg's n_k), normalised to sum 1.
    """

    def __init__(self, inner,
                 on_update: Callable[[str, dict[str, np.ndarray], Mapping[str, Any]], Any] | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_per_site_updates = inner.needs_per_site_updates
        self.on_update = on_update
        self.rounds: list[dict[str, dict[str, Any]]] = []
        self._global: Mapping[str, Any] = {}
        self._weights: dict[str, float] = {}
        self._clients: dict[str, Any] = {}

    def weight_for(self, num_samples: int, metrics: Mapping[str, float]) -> float:
        return self.inner.weight_for(num_samples, metrics)

    def begin(self, global_tensors) -> None:
        self._global, self._weights, self._clients = global_tensors, {}, {}
        self.inner.begin(global_tensors)

    def accept(self, update, weight: float, *, site: str) -> None:
        if self.on_update is not None:
            local = {n: np.asarray(self._global[n]) + np.asarray(d) for n, d in update.items()}
            self._clients[site] = self.on_update(site, {**self._global, **local}, update)
        self.inner.accept(update, weight, site=site)
        self._weights[site] = float(weight)

    def finalize(self):
        out = self.inner.finalize()
        coeff = getattr(self.inner, "alpha", None) or getattr(self.inner, "contributions", None) or self._weights
        total = sum(coeff.values())
        self.rounds.append({"omega": {s: float(v) / total for s, v in sorted(coeff.items())},
                            "weight": dict(sorted(self._weights.items())), "clients": self._clients})
        return out


@contextmanager
def registered(name: str, factory: Callable[..., RecordingStrategy]) -> Iterator[None]:
    """Make ``factory(**strategy_params)`` available to ``simulate(strategy=name, ...)`` while the block runs."""
    from fedclinic.strategies import STRATEGIES

    if name in STRATEGIES:
        raise ValueError(f"strategy name {name!r} is taken")
    STRATEGIES[name] = factory  # type: ignore[assignment]
    try:
        yield
    finally:
        del STRATEGIES[name]
