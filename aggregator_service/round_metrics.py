"""A closed round's figures, computed from its durable updates (the round's ``metrics`` in TaskStatus).

:func:`round_metrics` combines: the sample-weighted mean of the sites' training metrics, ``eval_*`` from
their evaluations of the round's base model (:func:`evaluation_metrics`: weighted by rows evaluated, small cells
left out, fedclinic.evaluation.combine), the privacy figures (:func:`privacy_metrics`), the uplink bytes
(:func:`uplink_metrics`) and, under SAFL, how many sites sent each layer (:func:`selection_metrics`).
Pure functions of their inputs.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from fedclinic.evaluation.combine import DEFAULT_MIN_CELL_ROWS, pool_evaluations
from fedclinic.training import safl
from fedclinic.proto import task_pb2
from fedclinic.strategies import ClientDP, Strategy

from aggregator_service.folding import UpdateLayout
from aggregator_service.store import SiteResultRecord, UpdateRecord


def privacy_metrics(site_metrics: list[dict[str, float]], strategy: Strategy) -> dict[str, float]:
    """A round's privacy figures: sample-level DP -> ``dp_epsilon`` / ``dp_delta`` = the largest cumulative spend
    any site reported (each site's guarantee covers its own records; the weakest one is the task's); client-level
    DP -> ``client_dp_epsilon`` (``client_dp_delta``) from the aggregator's own accountant, and the clip norm."""
    out: dict[str, float] = {}
    spends = [m["dp_epsilon"] for m in site_metrics if "dp_epsilon" in m]
    if spends:
        out["dp_epsilon"] = max(spends)
        out["dp_delta"] = max(m.get("dp_delta", 0.0) for m in site_metrics)
    if isinstance(strategy, ClientDP):
        out["client_dp_epsilon"] = strategy.epsilon()
        out["client_dp_delta"] = strategy.delta
        out["client_dp_clip_norm"] = strategy.clip_norm
    return out


def uplink_metrics(reports: Sequence[UpdateRecord]) -> dict[str, float]:
    """A round's update bytes summed over its sites: ``uplink_payload_bytes`` (tensor payloads as sent,
    encoded), ``uplink_fp32_bytes`` (the same tensors as float32 deltas), ``uplink_wire_bytes`` (serialized
    SubmitUpdate messages) and ``uplink_reduction`` = fp32 / payload. Empty without per-site updates (secure
    aggregation: see the round's ``uplink_bytes``)."""
    payload = sum(r.nbytes for r in reports)
    fp32 = sum(r.fp32_bytes for r in reports)
    if not reports or not fp32:
        return {}
    out = {"uplink_payload_bytes": float(payload), "uplink_fp32_bytes": float(fp32)}
    wire = sum(r.wire_bytes for r in reports)
    if wire:
        out["uplink_wire_bytes"] = float(wire)
    if payload:
        out["uplink_reduction"] = fp32 / payload
    return out


def update_layers(layout_json: str) -> list[int]:
    """The transformer layers a stored update carried (from its tensor names; fedclinic.training.safl.layer_of)."""
    return safl.layers_in_update(t[0] for t in UpdateLayout.from_json(layout_json).tensors)


def selection_metrics(per_site_layers: list[list[int]]) -> dict[str, float]:
    """SAFL's round figures: ``safl_layer_<l>_sites`` = how many sites sent layer l (a layer nobody sent is not
    listed). Counted from the tensors each update carried, not from what a site says it chose."""
    counts: dict[int, int] = {}
    for layers in per_site_layers:
        for layer in layers:
            counts[layer] = counts.get(layer, 0) + 1
    return {f"safl_layer_{layer}_sites": float(n) for layer, n in sorted(counts.items())}


def weighted_mean(reports: Iterable[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Each metric's mean over the reports that carry it (finite values only), weighted by sample count."""
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for n, metrics in reports:
        for k, v in metrics.items():
            if math.isfinite(v):
                totals[k] = totals.get(k, 0.0) + n * v
                weights[k] = weights.get(k, 0.0) + n
    return {k: totals[k] / weights[k] for k in totals if weights[k] > 0}


def site_evaluations(reports: Sequence[UpdateRecord], results: Sequence[SiteResultRecord] = ()
                     ) -> dict[str, tuple[dict[str, float], int]]:
    """site -> (its evaluation of the round's base model, its min_cell_rows): the one it sent after its update
    (SubmitResult, model "round") or else the one in its update header (an older agent; k = the default)."""
    out = {r.site: (dict(r.eval_metrics), DEFAULT_MIN_CELL_ROWS) for r in reports if r.eval_metrics}
    out.update({r.site: (dict(r.values), r.min_cell) for r in results if r.model == "round"})
    return out


def evaluation_metrics(reports: Sequence[UpdateRecord], results: Sequence[SiteResultRecord] = ()
                       ) -> dict[str, float]:
    """A round's ``eval_*`` figures: the sites' evaluations (:func:`site_evaluations`) pooled by
    fedclinic.evaluation.combine (counts summed, the rest weighted by ``eval_rows``, suppressed cells left out),
    ``eval_rows`` = the rows pooled and ``eval_sites`` = how many sites are in the pool."""
    evals = site_evaluations(reports, results)
    if not evals:
        return {}
    pooled = pool_evaluations({s: v for s, (v, _) in evals.items()}, {s: k for s, (_, k) in evals.items()})
    out = {k if k == "eval_rows" else f"eval_{k}": v for k, v in pooled.values.items()}
    out["eval_sites"] = float(pooled.sites)
    return out


def round_metrics(spec: task_pb2.TaskSpec, reports: Sequence[UpdateRecord], strategy: Strategy,
                  extra: dict[str, float] | None = None, results: Sequence[SiteResultRecord] = ()
                  ) -> dict[str, float]:
    """The figures of a round closed with ``reports`` (see the module docstring) and the evaluations sent after
    the updates (``results``); ``extra`` is added last."""
    metrics = weighted_mean((r.num_samples, r.metrics) for r in reports)
    metrics.update(evaluation_metrics(reports, results))
    metrics.update(privacy_metrics([r.metrics for r in reports], strategy))
    metrics.update(uplink_metrics(reports))
    if spec.update.selection == safl.SAFL:
        metrics.update(selection_metrics([update_layers(r.layout) for r in reports]))
    metrics.update(extra or {})
    return metrics
