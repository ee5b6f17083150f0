"""Aggregation strategies (one small class each, streaming interface in :mod:`.base`)."""

from __future__ import annotations

from typing import Mapping

from fedclinic.errors import ConfigError
from fedclinic.strategies.base import Strategy
from fedclinic.strategies.client_dp import ClientDP
from fedclinic.strategies.dynamic import DynamicWeighting
from fedclinic.strategies.fedatt import FedAtt
from fedclinic.strategies.fedavg import FedAvg
from fedclinic.strategies.fedopt import FedAdagrad, FedAdam, FedAvgM, FedYogi
from fedclinic.strategies.robust import Median, MultiKrum, NormBounded, TrimmedMean
from fedclinic.strategies.weipro import WeiPro

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    FedAvg, ClientDP, FedAvgM, FedAtt, DynamicWeighting, WeiPro, FedAdagrad, FedAdam, FedYogi, Median, TrimmedMean, NormBounded, MultiKrum)}


def make_strategy(name: str, params: Mapping[str, float] | None = None) -> Strategy:
    """Build a strategy by name with keyword parameters; unknown names or parameters are a ConfigError."""
    try:
        cls = STRATEGIES[name or "fedavg"]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose one of: {', '.join(sorted(STRATEGIES))}") from None
    try:
        return cls(**dict(params or {}))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"strategy {name!r}: bad parameters {dict(params or {})}: {exc}") from None


__all__ = ["STRATEGIES", "ClientDP", "DynamicWeighting", "FedAtt", "FedAdagrad", "FedAdam", "FedAvg", "FedAvgM", "FedYogi", "Median", "MultiKrum", "NormBounded", "Strategy",
           "TrimmedMean", "WeiPro", "make_strategy"]
