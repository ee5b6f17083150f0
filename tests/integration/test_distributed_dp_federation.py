"""Distributed DP over the real services (privacy level "distributed", Skellam): four agent processes, one of them
crashing (``os._exit`` at a failpoint: no cleanup, like SIGKILL) after it shared its keys and before its masked input;
the task still completes on the three survivors, the published model moved by noise of exactly the planned variance
(the learning rate is so small that the sites' deltas are ~1e-6 of it), the aggregator's path added none (its
strategy is the plain mean, the variance is the sites' shares alone, and ``fedclinic task verify`` recomputes each
published model from the round's published unmasked sum), and each round summary's epsilon is the accountant's for
the rounds so far with the noise of that round's survivors.

The statistic: round r's model minus round r-1's is ``mean of 3 deltas + N / (3 gamma)`` per value, ``N ~
Skellam(3 mu_site)``; over the model's d ~ 5000 values the sample variance's relative standard error is
``sqrt(2 / d)`` ~ 2%; the check allows 5.3 of them (false-failure probability ~1e-7). An aggregator that added its
own noise of the same size, or a site that skipped its share, moves the variance by a third or more."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedclinic.cli import main as fedclinic_main
from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until
from fedclinic.secagg import dp_plan
from fedclinic.secagg.task_config import floor_of

from tests.helpers.federation import streams_open
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

TARGET = 8.0



def test_a_crashed_site_leaves_the_survivors_noise_of_the_planned_variance_and_the_accountants_epsilon(
        federation_factory, monkeypatch, capsys):
    fed = federation_factory(4, samples=(24, 32, 40, 48), start=False)
    fed.make_pki()
    fed.start_aggregator()
    for site in ("site-a", "site-b", "site-c"):
        fed.start_agent(site)
    monkeypatch.setenv("FEDCLINIC_FAILPOINTS", "agent.secagg.before-masked-input")
    doomed = fed.start_agent("site-d")  # joins the session, shares keys, then dies before its masked input
    monkeypatch.delenv("FEDCLINIC_FAILPOINTS")
    wait_until(lambda: len(streams_open(fed)) == 4, 120, "four agents' work streams")
    task = make_task(architecture="lstm", num_rounds=2, min_sites=3, round_timeout_s=60, local_epochs=1,
                     learning_rate=1e-6, seed=1, secure_aggregation={"enabled": True, "weighting": "uniform"},
                     privacy={"level": "distributed", "target_epsilon": TARGET, "target_delta": 1e-5,
                              "max_grad_norm": 1.0})
    with fed.client() as client:
        st = client.submit(task, package=tiny_package("lstm"))
        assert doomed.wait(120) == 97  # died at the failpoint: inside the session, before its masked input
        final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        events = [f"{e.kind}: {e.message}" for e in client.watch(st.task_id)]
        models = [client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)]
    assert any("dropped after sharing keys: site-d" in e for e in events), events
    assert any("distributed DP" in e and "the aggregator adds none" in e for e in events), events
    assert final.spec.strategy in ("", "fedavg")  # the plain mean: no noise of the aggregator's own

    spec = final.spec
    d = sum(int(np.prod(t.shape)) for t in models[0].tensors.values())
    floor = floor_of(spec)
    assert floor == 3
    mu = dp_plan.site_variance(spec, d, floor)
    sens = dp_plan.sensitivity_of(spec, d)
    gamma = dp_plan.scale_of(spec, d)
    survivors = []
    for i, rnd in enumerate(final.rounds):
        m = int(rnd.metrics["secagg_survivors"])
        survivors.append(m)
        assert rnd.ddp_noise_sites == m and rnd.ddp_mechanism == "skellam" and rnd.ddp_delta == 1e-5
        assert rnd.ddp_epsilon == pytest.approx(sens.epsilon([s * mu for s in survivors], 1e-5), rel=1e-9)
        assert rnd.metrics["ddp_epsilon"] == rnd.ddp_epsilon
        planned = math.sqrt(m * mu) / (gamma * m)
        assert rnd.ddp_noise_stddev == pytest.approx(planned, rel=1e-12)
        before, after = models[i], models[i + 1]
        change = np.concatenate([(after.tensors[n].astype(np.float64) - before.tensors[n]).ravel()
                                 for n in before.tensors])
        assert change.size == d
        assert abs(change.var() / planned ** 2 - 1) <= 5.3 * math.sqrt(2 / d) + 0.01, (change.var(), planned ** 2)
        assert abs(change.mean()) <= 5.3 * planned / math.sqrt(d) + 1e-4
    assert survivors == [3, 3]  # the crashed site's share is gone; the three survivors' shares are what was planned
    assert final.rounds[-1].ddp_epsilon == pytest.approx(TARGET, rel=1e-6) and final.rounds[-1].ddp_epsilon <= TARGET
    assert not list(final.rounds[0].reports)  # nothing per site was stored or shown
    # anyone can recompute each published model from the round's published unmasked (noisy) sum: the aggregator
    # added nothing between unmasking and publishing
    c = fed.creds("scientist")
    capsys.readouterr()
    code = fedclinic_main(["task", "verify", st.task_id, "--address", fed.address, "--cert", c["cert"], "--key",
                           c["key"], "--ca", c["ca"], "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["ok"], doc
    assert [r["aggregate"] for r in doc["rounds"]] == ["recomputed: matches"] * 2
