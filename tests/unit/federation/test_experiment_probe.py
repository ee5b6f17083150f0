"""experiments/strategy_probe.py: the recording wrapper the IU-CXR and CancersQA studies run the simulator with.

It must not change what the wrapped strategy computes, its recorded shares must be the strategy's own per-site
coefficients, and the client model it hands to ``on_update`` must be the site's model after local training."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedclinic.data.text import Example
from fedclinic.models import build_model, module_tensors, package_from_config, wordlevel_tokenizer_json
from fedclinic.federation.simulate import simulate
from fedclinic.federation.site_round import site_seed
from fedclinic.strategies import STRATEGIES, make_strategy
from fedclinic.training.trainer import TrainConfig, encode, train_local

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))
from strategy_probe import RecordingStrategy, registered  # noqa: E402

WORDS = {"a": ["fever", "cough"], "b": ["rash", "itch"]}
TOK = wordlevel_tokenizer_json(["the", "patient", "has"] + [w for ws in WORDS.values() for w in ws])


def sites() -> list[list[Example]]:
    rng = np.random.default_rng(0)

    def rows(n: int) -> list[Example]:
        out = []
        for _ in range(n):
            lab = "a" if rng.random() < 0.5 else "b"
            out.append(Example(f"the patient has {WORDS[lab][int(rng.integers(2))]}", (lab,)))
        return out

    return [rows(12), rows(30), rows(6)]


def package():
    return package_from_config(architecture="logreg", labels=["a", "b"], tokenizer_json=TOK, config={},
                               max_length=8, seed=0)


CFG = TrainConfig(learning_rate=0.1, batch_size=4, max_length=8, device="cpu")


@pytest.mark.parametrize("strategy,params", [("fedavg", {}), ("dynamic-weighting", {"definition": "report"}),
                                             ("weipro", {})])
def test_recording_changes_nothing_and_records_the_strategys_own_shares(strategy, params):
    plain = simulate(package(), sites(), rounds=2, train=CFG, strategy=strategy, strategy_params=params, seed=3)
    recorders: list[RecordingStrategy] = []
    clients: list[tuple[str, dict, dict]] = []

    def factory(**p):
        recorders.append(RecordingStrategy(make_strategy(strategy, p),
                                           on_update=lambda s, t, u: clients.append((s, t, dict(u))) or len(u)))
        return recorders[-1]

    with registered("probe-under-test", factory):
        probed = simulate(package(), sites(), rounds=2, train=CFG, strategy="probe-under-test", strategy_params=params,
                          seed=3)
    assert "probe-under-test" not in STRATEGIES
    for name, value in plain.package.tensors.items():
        np.testing.assert_array_equal(probed.package.tensors[name], value)
    rounds = recorders[0].rounds
    assert len(rounds) == 2 and all(set(r["omega"]) == {"site-0", "site-1", "site-2"} for r in rounds)
    assert all(sum(r["omega"].values()) == pytest.approx(1.0) for r in rounds)
    inner = recorders[0].inner
    if strategy == "fedavg":
        assert rounds[0]["omega"] == pytest.approx({"site-0": 12 / 48, "site-1": 30 / 48, "site-2": 6 / 48})
    elif strategy == "weipro":
        assert rounds[-1]["omega"] == pytest.approx(inner.alpha)
    else:
        total = sum(inner.contributions.values())
        assert rounds[-1]["omega"] == pytest.approx({s: c / total for s, c in inner.contributions.items()})
    # the client model handed to on_update is the site's model after local training: redo site-0's round 1 directly
    site, local, update = clients[0]
    assert site == "site-0" and rounds[0]["clients"]["site-0"] == len(update)
    loaded = build_model(package())
    train_local(loaded, encode(sites()[0], loaded, max_length=8), replace(CFG, seed=site_seed(CFG.seed, 1, "site-0")),
                trainable=list(update))
    for name, value in module_tensors(loaded.module, list(update)).items():
        np.testing.assert_allclose(local[name], value, atol=1e-6)
    assert any(np.abs(d).max() > 0 for d in update.values())


def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match="taken"):
        with registered("fedavg", lambda **p: None):
            pass
    assert STRATEGIES["fedavg"].name == "fedavg"
