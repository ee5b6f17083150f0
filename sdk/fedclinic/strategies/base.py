"""The streaming strategy interface shared by the simulator and the aggregator service.

A strategy sees one round as::

    strategy.begin(global_tensors)            # the model the round started from
    strategy.accept(update, strategy.weight_for(n, metrics), site=...)  # once per site, in arrival order
    new_tensors = strategy.finalize()         # tensors that changed; the rest stay as they were
                                              # (arrays; FileTensors after spill_to)

``accept`` either takes the whole update or raises (IntegrityError/ValueError) *before* changing any
state: the aggregator folds an update before recording it and relies on a refused update leaving no trace.

Updates are deltas (local - global) over a subset of tensor names, given as numpy arrays or as
:class:`~fedclinic.strategies.tensorsource.FileTensor` (read block by block, see ``tensorsource.blocks``).
``accept`` must not keep references to ``update``, so memory stays O(model size) whatever the number of
sites. Two-pass strategies (median, trimmed mean, multi-Krum) keep references until ``finalize``; the
aggregator hands them spill files, never in-memory copies. A strategy that looks at individual updates
(their norms, distances or coordinates) sets ``needs_per_site_updates``: it cannot run on the masked sum
that secure aggregation yields.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.strategies.tensorsource import TensorLike


class Strategy(ABC):
    name: ClassVar[str]
    #: True when the strategy looks at individual updates, so it cannot work on a sum alone (secure aggregation).
    needs_per_site_updates: ClassVar[bool] = False

    @abstractmethod
    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None: ...

    @abstractmethod
    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None: ...

    @abstractmethod
    def finalize(self) -> dict[str, TensorLike]: ...

    def spill_to(self, folder: Path | None) -> None:
        """Keep the round's model-sized accumulators in files under ``folder`` rather than in memory, so a fold
        holds one tensor at a time (called before :meth:`begin`; ``finalize`` may then return FileTensors).
        A strategy that cannot spill ignores it and keeps them in memory (this default)."""

    def weight_for(self, num_samples: int, metrics: Mapping[str, float]) -> float:
        """The ``weight`` handed to :meth:`accept` for a site's update: its sample count, unless the strategy
        weights by something the site reported in its update's metrics (IntegrityError if that is missing)."""
        return float(num_samples)

    def site_metrics(self) -> tuple[str, ...]:
        """Metrics every site must report with its update for this strategy (checked when a task is submitted)."""
        return ()

    def partial_updates_problem(self) -> str:
        """Why this strategy cannot aggregate a round whose sites sent different subsets of the tensors (SAFL's
        attention-selected layers), or "" when it can: then a tensor is aggregated over the sites that sent it,
        and a tensor nobody sent keeps its global value. Checked when a SAFL task is submitted."""
        return f"strategy {self.name!r} has not been checked with updates that carry different tensors"

    def min_updates(self) -> int:
        """Fewest updates a round needs for this strategy to produce a model (checked against min_sites)."""
        return 1

    def state(self) -> dict[str, np.ndarray]:
        """Server state carried to the next round (e.g. optimizer moments); empty for stateless strategies.

        The aggregator stores it with the round that produced it and hands it to :meth:`load_state` of the
        next round's strategy, so a restart in between changes nothing.
        """
        return {}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned after the previous round."""
        if state:
            raise ValueError(f"strategy {self.name!r} keeps no state but was given {sorted(state)[:3]}")
