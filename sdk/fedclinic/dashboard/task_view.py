"""A task's status as the dashboard's data: JSON-ready dicts of plain values, no HTML.

Everything comes from one ``TaskStatus`` of the control API (what ``fedclinic task status`` prints), so the page
shows exactly what the user's certificate may read. The site states of a round are those of
:func:`fedclinic.client.waiting_sites` / :func:`~fedclinic.client.held_sites`: *reported* (an update arrived),
*declined* (the site refused, with its reason), *held* (the site holds the assignment without refusing, e.g.
awaiting its IT's approval, with its reason) and *waiting* (assigned, neither an update nor a refusal yet: the
aggregator cannot tell a site still training from one that is offline).
"""

from __future__ import annotations

import math
from typing import Any

from fedclinic.client import RESULT_FIRST, evaluated_model, held_sites, state_name, waiting_sites
from fedclinic.proto import control_pb2

#: a round's figures the "global metrics" plot draws first, when present (then other eval_* scores in name order)
GLOBAL_FIRST = ("eval_macro_auc", "eval_accuracy", "eval_macro_f1", "eval_strict_f1", "eval_rougeL", "eval_loss",
                "loss", "train_loss")
#: at most this many global metrics are plotted
GLOBAL_SERIES = 4
#: eval_* round figures that are counts or rates, not scores: neither plotted nor shown in the rounds table
COUNT_SUFFIXES = ("_rows", "_sites", "steps", "_bytes", "_seconds", "_rate")
#: the per-site figure plotted: the first of these a site reported (training loss, then its evaluation)
SITE_METRICS = ("loss", "train_loss", "eval_macro_auc", "eval_accuracy", "eval_strict_f1")
#: privacy spend per round, by kind of DP (the first present is plotted)
EPSILON_KEYS = (("dp_epsilon", "sample-level DP ε (largest site)"), ("client_dp_epsilon", "client-level DP ε"),
                ("ddp_epsilon", "distributed DP ε"))


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def task_summary(st: control_pb2.TaskStatus) -> dict[str, Any]:
    """One line of the task list: id, name, state, rounds closed of planned, owner, last update."""
    closed = sum(1 for r in st.rounds if r.state == control_pb2.ROUND_STATE_CLOSED)
    return {"task_id": st.task_id, "name": st.spec.name, "state": state_name(st.state), "owner": st.owner,
            "rounds_closed": closed, "rounds_planned": st.spec.rounds.num_rounds,
            "current_round": st.current_round, "updated_unix_ms": st.updated_unix_ms, "signed": st.signed}


def round_sites(st: control_pb2.TaskStatus, r: control_pb2.RoundSummary) -> list[dict[str, str]]:
    """Every site of round ``r`` (assigned, reporting or declining), sorted, with its state and why."""
    reported = {rep.site_id: rep for rep in r.reports}
    declined = {}
    for d in r.declined:
        site, _, why = d.partition(":")
        declined[site] = why.strip()
    is_last = bool(st.rounds) and st.rounds[-1].round == r.round and st.rounds[-1].attempt == r.attempt
    held = held_sites(st) if is_last else {}
    waiting = set(waiting_sites(st)) if is_last else set()
    out = []
    for site in sorted(set(r.sites_assigned) | set(reported) | set(declined)):
        if site in reported:
            rep = reported[site]
            out.append({"site": site, "state": "reported", "detail": f"{rep.num_samples} samples, "
                                                                     f"{rep.uplink_bytes:,} B up"})
        elif site in declined:
            out.append({"site": site, "state": "declined", "detail": declined[site]})
        elif site in held:
            out.append({"site": site, "state": "held", "detail": held[site]})
        elif site in waiting:
            out.append({"site": site, "state": "waiting",
                        "detail": "no update or refusal yet: still training, or offline"})
        elif r.state == control_pb2.ROUND_STATE_OPEN and st.spec.secure_aggregation.enabled:
            out.append({"site": site, "state": "secure", "detail": "secure aggregation: no per-site progress"})
        else:
            out.append({"site": site, "state": "no answer", "detail": "sent neither an update nor a refusal"})
    return out


def _round_row(r: control_pb2.RoundSummary) -> dict[str, Any]:
    metrics = {k: v for k, v in sorted(r.metrics.items()) if "/" not in k and math.isfinite(v)}
    epsilon = next((r.metrics[k] for k, _ in EPSILON_KEYS if k in r.metrics), None)
    if epsilon is None and r.ddp_epsilon:
        epsilon = r.ddp_epsilon
    return {"round": r.round, "attempt": r.attempt, "state": control_pb2.RoundState.Name(r.state)
            .removeprefix("ROUND_STATE_").lower(), "reports": len(r.reports), "sites_target": r.sites_target,
            "uplink_bytes": r.uplink_bytes, "downlink_bytes": r.downlink_bytes, "metrics": metrics,
            "epsilon": epsilon, "declined": len(r.declined), "eval_sites": r.eval_sites,
            "evaluated": evaluated_model(r.round) if r.eval_sites else ""}


def _closed(st: control_pb2.TaskStatus) -> list[control_pb2.RoundSummary]:
    return [r for r in st.rounds if r.state == control_pb2.ROUND_STATE_CLOSED]


def metric_order(keys: set[str] | list[str]) -> list[str]:
    """The round metrics the page shows (``task status --json`` has them all): :data:`GLOBAL_FIRST` first, then
    the other ``eval_*`` scores in name order; counts and rates (:data:`COUNT_SUFFIXES`), per-label figures
    (``name/label``) and the rest (timings, privacy figures: their own column and plot) left out."""
    keys = set(keys)
    return [k for k in GLOBAL_FIRST if k in keys] + sorted(
        k for k in keys if k.startswith("eval_") and k not in GLOBAL_FIRST and "/" not in k
        and not k.endswith(COUNT_SUFFIXES))


def plot_series(st: control_pb2.TaskStatus) -> dict[str, dict[str, Any]]:
    """The plots of the closed rounds: name -> {"title", "series": {label: [[round, value], ...]}, "unit"}.

    ``global``: the rounds' sample-weighted metrics (:data:`GLOBAL_FIRST` first, at most :data:`GLOBAL_SERIES`);
    ``sites``: each site's own figure per round (the first of :data:`SITE_METRICS` any site reported);
    ``bytes``: bytes up (the sites' updates as sent) and down (the model fetches) per round;
    ``epsilon``: the cumulative privacy spend after each round (private tasks only).
    A plot without any point is left out."""
    closed = _closed(st)
    plots: dict[str, dict[str, Any]] = {}
    ordered = metric_order({k for r in closed for k in r.metrics if "/" not in k})
    series = {k: [[r.round, v] for r in closed if k in r.metrics
                  for v in [_finite(r.metrics[k])] if v is not None] for k in ordered}
    series = dict(list((k, v) for k, v in series.items() if v)[:GLOBAL_SERIES])
    if series:
        plots["global"] = {"title": "global metrics per round (sample-weighted over the reporting sites)",
                           "series": series, "unit": ""}
    site_key = next((k for k in SITE_METRICS if any(k in rep.metrics or k in rep.eval_metrics
                                                    for r in closed for rep in r.reports)), None)
    if site_key is not None:
        per_site: dict[str, list[list[float]]] = {}
        for r in closed:
            for rep in r.reports:
                value = rep.metrics.get(site_key, rep.eval_metrics.get(site_key))
                if value is not None and math.isfinite(value):
                    per_site.setdefault(rep.site_id, []).append([r.round, float(value)])
        plots["sites"] = {"title": f"{site_key} per site and round", "series": dict(sorted(per_site.items())),
                          "unit": ""}
    if closed:
        plots["bytes"] = {"title": "bytes per round", "unit": "B",
                          "series": {"up": [[r.round, float(r.uplink_bytes)] for r in closed],
                                     "down": [[r.round, float(r.downlink_bytes)] for r in closed]}}
    eps = [[row["round"], row["epsilon"]] for row in map(_round_row, closed) if row["epsilon"] is not None]
    if eps:
        label = next((name for k, name in EPSILON_KEYS if any(k in r.metrics for r in closed)), "ε")
        plots["epsilon"] = {"title": "privacy spent (cumulative ε after each round)", "series": {label: eps},
                            "unit": ""}
    return plots


def results_view(st: control_pb2.TaskStatus) -> dict[str, Any] | None:
    """The result phase (cross-site evaluation or statistics) as tables, None before it exists.

    ``matrix``: sites x models of the headline value (the first of RESULT_FIRST other than eval_rows present),
    with the pooled row; ``cells``: every (site, model) with its values; ``statistics``: key -> site -> value
    (and "pooled") for a statistics task."""
    if not st.HasField("results") and not st.site_statistics:
        return None
    ph = st.results
    out: dict[str, Any] = {"work": ph.work, "open": ph.open, "model_hash": ph.model_hash,
                           "declined": list(ph.declined), "waiting": list(ph.waiting)}
    keys = {k for c in ph.cells for k in c.values} | {k for p in ph.pooled for k in p.values}
    headline = next((k for k in RESULT_FIRST if k in keys and k != "eval_rows"), min(keys, default=""))
    models = list(dict.fromkeys(c.model for c in ph.cells)) + [p.model for p in ph.pooled
                                                               if p.model not in {c.model for c in ph.cells}]
    rows: dict[str, dict[str, Any]] = {}
    for c in ph.cells:
        rows.setdefault(c.site_id, {})[c.model] = ("suppressed" if c.suppressed else
                                                   _finite(c.values[headline]) if headline in c.values else None)
    pooled = {p.model: (_finite(p.values[headline]) if headline in p.values else p.note or None) for p in ph.pooled}
    out["matrix"] = {"metric": headline, "models": models, "rows": dict(sorted(rows.items())), "pooled": pooled}
    out["cells"] = [{"site": c.site_id, "model": c.model, "rows": c.rows, "suppressed": c.suppressed,
                     "values": {k: v for k, v in sorted(c.values.items()) if math.isfinite(v)}} for c in ph.cells]
    if st.site_statistics:
        stat_keys = sorted({k for v in st.site_statistics.values() for k in v.values} | set(st.pooled_statistics))
        out["statistics"] = {"sites": sorted(st.site_statistics), "keys": stat_keys,
                             "values": {s: dict(v.values) for s, v in sorted(st.site_statistics.items())},
                             "pooled": dict(st.pooled_statistics)}
    return out


def task_view(st: control_pb2.TaskStatus) -> dict[str, Any]:
    """The whole page's data for one task: summary, rounds, the last round's sites, plots, results."""
    last = st.rounds[-1] if st.rounds else None
    return {**task_summary(st), "error": st.error, "kind": st.spec.kind or "train",
            "secure_aggregation": st.spec.secure_aggregation.enabled,
            "rounds": [_round_row(r) for r in st.rounds],
            "sites": round_sites(st, last) if last is not None else [],
            "sites_round": last.round if last is not None else 0,
            "sites_round_open": last is not None and last.state == control_pb2.ROUND_STATE_OPEN,
            "plots": plot_series(st), "results": results_view(st)}
