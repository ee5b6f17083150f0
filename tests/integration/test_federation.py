"""A task submitted through the SDK runs across real agent processes over mTLS; results are exact."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until
from fedclinic.transport.package import ModelPackage

from tests.helpers.federation import streams_open
from tests.helpers.replay import replay_site
from tests.helpers.tasks import make_task
from tests.helpers.text_models import make_examples, tiny_package

pytestmark = pytest.mark.integration


def test_task_completes_across_three_agents_and_equals_fedavg(federation_factory, tmp_path):
    fed = federation_factory(3, samples=(24, 32, 40))
    package = tiny_package("logreg")
    with fed.client() as client:
        status = client.submit(make_task(), package=package)
        final = client.wait(status.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert [len(r.reports) for r in final.rounds] == [3, 3]
        assert all(r.uplink_bytes > 0 and r.downlink_bytes > 0 for r in final.rounds)
        models = {r: client.fetch_package(status.task_id, round=r) for r in (-1, 1, 2)}
        final_pkg = client.fetch_package(status.task_id)
        downloaded = client.download(status.task_id, tmp_path / "final-model")
    assert final_pkg.manifest().model_hash == models[2].manifest().model_hash
    # the model card written beside the download: 2 rounds by 3 sites, the last round's metrics
    card = json.loads((downloaded / "model_card.json").read_text())
    assert card["rounds_completed"] == 2 and card["num_sites"] == 3 and card["is_final"] is True
    assert card["sites"] == ["site-a", "site-b", "site-c"] and card["task"]["id"] == status.task_id
    assert card["final_round_metrics"] == dict(final.rounds[-1].metrics) and card["final_round_metrics"]
    assert card["model_hash"] == final.final_model_hash == ModelPackage.load(downloaded).manifest().model_hash
    assert "# Model card: it" in (downloaded / "MODEL_CARD.md").read_text()
    # round-2 downlink: only the changed (trained) tensors travel, never the whole model twice
    site_rows = {f"site-{c}": make_examples(n, seed=i) for i, (c, n) in enumerate(zip("abc", (24, 32, 40)))}
    for rnd, start in ((1, models[-1]), (2, models[1])):
        deltas = [replay_site(start, rows, final.spec, site=site, rnd=rnd) for site, rows in site_rows.items()]
        total = sum(n for _, n in deltas)
        for name, base in start.tensors.items():
            expected = base + sum(n * d[name] for d, n in deltas) / total
            np.testing.assert_allclose(models[rnd].tensors[name], expected, rtol=1e-4, atol=1e-6,
                                       err_msg=f"round {rnd} tensor {name}")
    # the reports carry each site's sample count
    assert sorted(r.num_samples for r in final.rounds[0].reports) == [24, 32, 40]


def test_policy_refusal_reaches_the_task_owner(federation_factory):
    fed = federation_factory(2)
    with fed.client() as client:
        # the task names its sites: once both declined it for good it fails at once (not at its round deadline)
        st = client.submit(make_task(dataset="not-registered", min_sites=1, num_rounds=1, round_timeout_s=300,
                                     sites=["site-a", "site-b"]), package=tiny_package("logreg"))
        final = client.wait(st.task_id, timeout=120, progress=False)
    assert state_name(final.state) == "failed"
    declined = final.rounds[0].declined
    assert len(declined) == 2 and all("no dataset named 'not-registered'" in d or "does not allow" in d
                                      for d in declined)
    assert "quorum" in final.error


def test_large_model_goes_both_ways_without_raising_message_limits(federation_factory):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    package = tiny_package("logreg")
    rng = np.random.default_rng(0)
    package.tensors["extra.big"] = rng.standard_normal(18 * 1024 * 1024, dtype=np.float32)  # 72 MiB
    with fed.client() as client:
        st = client.submit(make_task(min_sites=1, num_rounds=1, frozen=[r"extra\.big"]),
                           package=package)
        back = client.fetch_package(st.task_id, round=-1)
    assert back.manifest().model_hash == package.manifest().model_hash
    assert np.array_equal(back.tensors["extra.big"], package.tensors["extra.big"])


def test_data_contract_violation_is_refused_with_rule_and_row(federation_factory, tmp_path):
    fed = federation_factory(2, start=False)
    bad = fed.sites["site-b"].datasets["notes"]["path"]
    with open(bad, "a") as fh:
        fh.write('{"text": "gout flare in the big toe", "label": "rheumatology"}\n')
    fed.start()
    # both sites must hold their work stream when round 1 opens (a site that connects later is not asked); the task
    # names its two sites, so site-b's decline for good (a data problem) leaves quorum out of reach and the task
    # fails at once instead of at its round deadline
    wait_until(lambda: streams_open(fed) >= {"site-a", "site-b"}, 60, "both agents' work streams")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, sites=["site-a", "site-b"], round_timeout_s=120),
                           package=tiny_package())
        final = client.wait(st.task_id, timeout=150, progress=False)
    assert state_name(final.state) == "failed"
    assert "quorum can no longer be reached" in final.error, final.error
    refusal = [d for d in final.rounds[0].declined if d.startswith("site-b")]
    # the rule and the row reach the task owner; the row's content and the site's path stay at the site (issue 16,
    # item 8: test_site_data_leaks.py scans everything the aggregator holds)
    assert refusal and "not in the task's label set" in refusal[0] and "row 33" in refusal[0]
    assert "rheumatology" not in refusal[0] and "train.jsonl" not in refusal[0]
    assert "site-b" not in [r.site_id for r in final.rounds[0].reports]  # site-b trained and sent nothing
    assert not list((fed.root / "agent-site-b" / "cache").glob("??/*"))  # and downloaded nothing


#: every strategy except FedAvg (tested above), with what its run exercises in the service
SERVICE_STRATEGIES = [
    ("fedadam", {"server_lr": 0.05}),        # state (moments) carried between rounds through the store
    ("fedadagrad", {"server_lr": 0.05}),
    ("fedyogi", {"server_lr": 0.05}),
    ("fedavgm", {"momentum": 0.5}),
    ("median", {}),                          # per-site strategies reading every spill file in lockstep
    ("trimmed-mean", {"beta": 0.34}),
    ("multi-krum", {"byzantine": 0}),
    ("norm-bounded", {"max_norm": 0.05}),    # two passes over each streamed update
    ("fedatt", {"server_lr": 1.5}),          # online softmax over per-tensor distances
    ("dynamic-weighting", {}),               # weights from the deltas' norms (the IU-CXR report)
    ("dynamic-weighting", {"definition": "code"}),  # weights the sites report (the IU-CXR notebook)
    ("weipro", {}),                          # three passes over spill files; phi kept in the strategy state
]


def test_every_strategy_through_the_service_matches_an_in_memory_replay(federation_factory):
    from fedclinic.strategies import STRATEGIES, make_strategy

    # fedavg runs everywhere else; dp-fedavg's noise cannot be replayed (its own test below)
    assert {name for name, _ in SERVICE_STRATEGIES} | {"fedavg", "dp-fedavg"} == set(STRATEGIES)
    samples = (24, 32, 40)
    fed = federation_factory(3, samples=samples)
    rows = [make_examples(n, seed=i) for i, n in enumerate(samples)]
    with fed.client() as client:
        submitted = [(name, params, client.submit(
            make_task(name=f"it-{name}", num_rounds=2, strategy=name, strategy_params=params,
                  measure_gradient_change=params.get("definition") == "code"), package=tiny_package()))
            for name, params in SERVICE_STRATEGIES]
        for strategy, params, st in submitted:
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", (strategy, final.error)
            models = {r: client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)}
            state: dict = {}
            for rnd, start in ((1, models[-1]), (2, models[1])):
                s = make_strategy(strategy, params)
                s.load_state(state)
                s.begin(start.tensors)
                for i, r in enumerate(rows):
                    out: list = []
                    delta, n = replay_site(start, r, final.spec, site=f"site-{'abc'[i]}", rnd=rnd, result_out=out)
                    s.accept(delta, s.weight_for(n, out[0].reported_metrics()), site=f"site-{'abc'[i]}")
                expected = s.finalize()
                state = s.state()
                for name, arr in expected.items():
                    np.testing.assert_allclose(models[rnd].tensors[name], arr, rtol=1e-4, atol=1e-6,
                                               err_msg=f"{strategy} round {rnd} tensor {name}")


def test_client_level_dp_through_the_service_adds_calibrated_noise_and_accounts(federation_factory):
    """dp-fedavg: the released model is the clipped, equally weighted mean of the replayed updates plus noise of
    standard deviation z*C/m; the round reports the aggregator's epsilon for the rounds so far."""
    from fedclinic.privacy.accounting import epsilon_of
    from fedclinic.strategies import make_strategy

    samples = (24, 32, 40)
    fed = federation_factory(3, samples=samples)
    rows = [make_examples(n, seed=i) for i, n in enumerate(samples)]
    params = {"clip_norm": 0.05, "noise_multiplier": 0.5}
    with fed.client() as client:
        st = client.submit(make_task(name="it-dp-fedavg", num_rounds=1, strategy="dp-fedavg", strategy_params=params,
                                 privacy={"level": "client"}), package=tiny_package())
        final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        start, released = client.fetch_package(st.task_id, round=-1), client.fetch_package(st.task_id, round=1)
    metrics = final.rounds[0].metrics
    assert metrics["client_dp_epsilon"] == pytest.approx(epsilon_of([(0.5, 1.0, 1)], 1e-5))
    assert metrics["client_dp_clip_norm"] == pytest.approx(0.05)

    class _NoNoise:
        def sample(self, shape, std, dtype=np.float32):
            return np.zeros(shape, dtype)

    from fedclinic.strategies import client_dp

    real = client_dp._noise_source
    client_dp._noise_source = _NoNoise
    try:
        s = make_strategy("dp-fedavg", params)
        s.begin(start.tensors)
        for i, r in enumerate(rows):
            delta, n = replay_site(start, r, final.spec, site=f"site-{'abc'[i]}", rnd=1)
            s.accept(delta, s.weight_for(n, {}), site=f"site-{'abc'[i]}")
        noise_free = s.finalize()
    finally:
        client_dp._noise_source = real
    residual = np.concatenate([(released.tensors[k] - v).ravel() for k, v in noise_free.items()])
    expected_std = 0.5 * 0.05 / 3
    assert 0.5 * expected_std < residual.std() < 2.0 * expected_std, (residual.std(), expected_std)


def test_fedpap_with_kept_optimizer_state_through_the_service_matches_a_replay(federation_factory):
    """FLCMC's FedPAP: PAdam at the agents with moments kept across rounds, attention aggregation."""
    from fedclinic.strategies import make_strategy

    samples = (24, 40)
    fed = federation_factory(2, samples=samples)
    rows = [make_examples(n, seed=i) for i, n in enumerate(samples)]
    params = {"server_lr": 2.0}
    with fed.client() as client:
        st = client.submit(make_task(name="it-fedpap", num_rounds=2, min_sites=2, strategy="fedatt", strategy_params=params,
                                 optimizer="padam", proximal_mu=0.1, optimizer_state="keep", learning_rate=0.01),
                           package=tiny_package())
        final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        models = {r: client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)}
    kept: dict[int, dict] = {}
    for rnd, start in ((1, models[-1]), (2, models[1])):
        s = make_strategy("fedatt", params)
        s.begin(start.tensors)
        for i, r in enumerate(rows):
            out: list = []
            delta, n = replay_site(start, r, final.spec, site=f"site-{'ab'[i]}", rnd=rnd, optimizer_state=kept.get(i),
                                    result_out=out)
            kept[i] = out[0].optimizer_state
            s.accept(delta, n, site=f"s{i}")
        for name, arr in s.finalize().items():
            np.testing.assert_allclose(models[rnd].tensors[name], arr, rtol=1e-4, atol=1e-6,
                                       err_msg=f"round {rnd} tensor {name}")
    assert kept[0] and all(state["step"] == 2 * 6 for state in kept[0].values())  # 2 rounds x 6 steps, kept
