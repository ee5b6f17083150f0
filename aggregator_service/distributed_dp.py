"""The aggregator's side of distributed DP (privacy level "distributed"): what a session's setup tells the sites, and
the round's privacy figures. The aggregator adds no noise: the sites' Skellam shares are already in the unmasked
sum (fedclinic.secagg.skellam_encoding), which :meth:`VectorLayout.decode` only reads as signed integers and divides
by ``gamma m``; the strategy then applies the mean as it is (fedavg and the server optimizers are post-processing).

Accounting: round ``r``'s sum carried the noise shares of its ``m_r`` survivors, total variance ``m_r mu_site``;
the epsilon after round ``r`` composes every closed round's Skellam release (``ddp_noise_sites`` of the earlier
rounds' stored metrics, and this round's survivors) with :class:`fedclinic.strategies.skellam_accounting.
SkellamSensitivity`, at the task's delta.
"""

from __future__ import annotations

from fedclinic.proto import control_pb2, task_pb2
from fedclinic.secagg import dp_plan
from fedclinic.secagg.vector_layout import VectorLayout

from aggregator_service.store import Store

METRIC_KEYS = ("ddp_epsilon", "ddp_delta", "ddp_noise_sites", "ddp_noise_stddev")


def setup_fields(layout: VectorLayout) -> dict[str, object]:
    """``SecAggSetup``'s distributed-DP fields (none without distributed DP)."""
    dp = layout.dp
    if dp is None:
        return {}
    return {"dp_mechanism": dp.mechanism, "dp_scale": dp.scale, "dp_site_variance": dp.site_variance,
            "dp_clip_norm": dp.clip_norm, "dp_rounding_beta": dp.beta}


def describe(layout: VectorLayout) -> str:
    """The session event's words for the noise plan ("" without distributed DP)."""
    dp = layout.dp
    if dp is None:
        return ""
    return (f", distributed DP: every site clips to L2 norm {dp.clip_norm:g}, scales by {dp.scale:g} and adds "
            f"{dp.mechanism} noise of variance {dp.site_variance:.6g} (the aggregator adds none)")


def round_metrics(store: Store, spec: task_pb2.TaskSpec, task_id: str, rnd: int, layout: VectorLayout,
                  survivors: int) -> dict[str, float]:
    """The round's privacy figures (:data:`METRIC_KEYS`): the accountant's epsilon after this round over every
    closed round, the delta, how many noise shares the sum carried and the noise's standard deviation per value of
    the released mean."""
    dp = layout.dp
    if dp is None:
        return {}
    earlier = [int(r.metrics["ddp_noise_sites"]) for r in store.rounds_of(task_id)
               if r.round < rnd and r.state == control_pb2.ROUND_STATE_CLOSED and "ddp_noise_sites" in r.metrics]
    delta = dp_plan.delta_of(spec)
    eps = dp.sensitivity.epsilon([m * dp.site_variance for m in earlier + [survivors]], delta)
    return {"ddp_epsilon": eps, "ddp_delta": delta, "ddp_noise_sites": float(survivors),
            "ddp_noise_stddev": dp.noise_stddev(survivors)}


def fill_summary(rs: control_pb2.RoundSummary, spec: task_pb2.TaskSpec) -> None:
    """Copy a closed round's distributed-DP metrics into its summary's fields 20-24."""
    m = rs.metrics
    if "ddp_epsilon" not in m:
        return
    rs.ddp_epsilon, rs.ddp_delta = m["ddp_epsilon"], m.get("ddp_delta", 0.0)
    rs.ddp_noise_sites, rs.ddp_noise_stddev = int(m.get("ddp_noise_sites", 0)), m.get("ddp_noise_stddev", 0.0)
    rs.ddp_mechanism = dp_plan.mechanism_of(spec)
