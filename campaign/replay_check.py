"""Does a finished task's model equal the replay of the updates its rounds counted?

Round by round, from the global model the aggregator published for the round before (round −1: the submitted
one), every counted site's update is recomputed with the agents' own shared training code
(tests.helpers.replay.replay_site: the same seed per site and round, the same data), and the round's published
model must be the base plus their sample-weighted mean (FedAvg), under secure aggregation the sample-weighted mean
of the survivors' updates within the protocol's quantization bound. An update folded twice, or one lost from a round
that still closed, moves the model off the replay. Tasks with sample-level DP cannot be replayed (their noise comes
from the OS's entropy, never from the task's seed); their counts and ledgers are checked instead.
"""

from __future__ import annotations

import re

import numpy as np

from tests.helpers.replay import replay_site

_SURVIVORS = re.compile(r"round (\d+): unmasked the sum of \d+ site\(s\) \(([^)]*)\)")


def secure_survivors(client, task_id: str) -> dict[int, list[str]]:
    """Round -> the sites whose masked inputs the secure sum holds (the task's ``secagg-result`` events)."""
    out: dict[int, list[str]] = {}
    for e in client.watch(task_id):
        if e.kind == "secagg-result":
            m = _SURVIVORS.search(e.message)
            if m:
                out[int(m.group(1))] = [s.strip() for s in m.group(2).split(",")]
    return out


def replay_problems(client, final, rows_of: dict[str, list[dict]], *, secure: bool) -> list[str]:
    """Problems of ``final`` (a completed task's status) against the replay (module docstring); ``rows_of`` maps
    each site to the rows it trains on."""
    task_id = final.task_id
    survivors = secure_survivors(client, task_id) if secure else {}
    problems: list[str] = []
    base = client.fetch_package(task_id, round=-1)
    for summary in final.rounds:
        rnd = summary.round
        published = client.fetch_package(task_id, round=rnd)
        replayed: dict[str, tuple] = {}
        if secure:  # sample-weighted like a plain round (issue 17): the weights were summed under the masks
            replayed = {s: replay_site(base, rows_of[s], final.spec, site=s, rnd=rnd)
                        for s in survivors.get(rnd, [])}
            weights = {s: float(n) for s, (_, n) in replayed.items()}
            bound = float(summary.metrics.get("secagg_error_bound", 0.0))
            rtol, atol = 0.0, 10 * bound + 1e-6
        else:
            weights = {r.site_id: float(r.num_samples) for r in summary.reports}
            rtol, atol = 1e-4, 1e-6
        if not weights:
            problems.append(f"round {rnd} of {task_id} closed with no counted update")
            base = published
            continue
        deltas = {s: (replayed[s] if s in replayed else replay_site(base, rows_of[s], final.spec, site=s, rnd=rnd))[0]
                  for s in weights}
        total = sum(weights.values())
        for name, start in base.tensors.items():
            if name not in published.tensors:
                continue
            expected = start + sum(w * deltas[s][name] for s, w in weights.items()) / total
            got = published.tensors[name]
            if got.shape != expected.shape or not np.allclose(got, expected, rtol=rtol, atol=atol):
                err = float(np.max(np.abs(got - expected))) if got.shape == expected.shape else float("inf")
                problems.append(f"round {rnd} of {task_id}: tensor {name} is off the replay of "
                                f"{sorted(weights)} by up to {err:.3g}")
        base = published
    return problems
