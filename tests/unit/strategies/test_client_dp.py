"""Client-level DP (dp-fedavg): exact clipping, calibrated noise, adaptive clipping's direction, state, accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.errors import ConfigError
from fedclinic.privacy.accounting import epsilon_of
from fedclinic.strategies import client_dp, make_strategy
from fedclinic.strategies.client_dp import ClientDP
from fedclinic.strategies.secure_gaussian import SecureGaussian


@pytest.fixture
def seeded(monkeypatch):
    monkeypatch.setattr(client_dp, "_noise_source", lambda: SecureGaussian.replay(1234, "test"))


def _round(strategy, updates, global_tensors):
    strategy.begin(global_tensors)
    for i, u in enumerate(updates):
        strategy.accept(u, strategy.weight_for(1000 * (i + 1), {}), site=f"s{i}")
    return strategy.finalize()


def test_clipping_equal_weights_and_noise_are_exact(seeded):
    g = {"w": np.zeros(1000, np.float32), "b": np.ones(3, np.float32)}
    updates = [{"w": np.full(1000, 3.0, np.float32), "b": np.zeros(3, np.float32)},   # norm ~94.9: clipped to 2
               {"w": np.full(1000, 0.01, np.float32), "b": np.zeros(3, np.float32)}]  # norm ~0.32: kept
    s = ClientDP(clip_norm=2.0, noise_multiplier=0.5)
    out = _round(s, updates, g)
    src = SecureGaussian.replay(1234, "test")
    noise = {n: src.sample(g[n].size, 0.5 * 2.0, np.float32) for n in ("w", "b")}
    clipped = updates[0]["w"] * (2.0 / np.linalg.norm(updates[0]["w"].astype(np.float64)))
    want_w = (clipped + updates[1]["w"] + noise["w"]) / 2  # equal weights, whatever the sample counts
    np.testing.assert_allclose(out["w"], want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["b"], 1 + noise["b"] / 2, rtol=1e-5, atol=1e-6)


def test_noise_has_the_calibrated_spread():
    g = {"w": np.zeros(200_000, np.float32)}
    s = ClientDP(clip_norm=1.5, noise_multiplier=0.8)
    out = _round(s, [{"w": np.zeros(200_000, np.float32)} for _ in range(4)], g)
    assert np.std(out["w"]) == pytest.approx(0.8 * 1.5 / 4, rel=0.02)


def _adaptive_rounds(norms: list[float], start: float, rounds: int) -> list[float]:
    s = ClientDP(clip_norm=start, noise_multiplier=0.3, adaptive=1, target_quantile=0.5, clip_lr=0.2,
                 count_noise=0.2)  # b~ moves by ~0.04 around the true share: the direction is decided by the data
    g = {"w": np.zeros(4, np.float32)}
    history = [s.clip_norm]
    for _ in range(rounds):
        _round(s, [{"w": np.array([n, 0, 0, 0], np.float32)} for n in norms], g)
        history.append(s.clip_norm)
    return history


def test_adaptive_clipping_moves_towards_the_target_quantile(seeded):
    """The sign test: with every update longer than C the clip norm must grow; shorter, it must shrink."""
    norms = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3
    up = _adaptive_rounds(norms, start=0.1, rounds=60)
    assert all(b > a for a, b in zip(up[:10], up[1:11]))  # all clipped (b~=0 < 0.5): C grows
    assert 2.0 <= up[-1] <= 4.0
    down = _adaptive_rounds(norms, start=50.0, rounds=60)
    assert all(b < a for a, b in zip(down[:10], down[1:11]))  # none clipped (b~=1 > 0.5): C shrinks
    assert 2.0 <= down[-1] <= 4.0
    # one step from a known state: C * exp(-0.2 * (b~ - 0.5)) with b~ = (5 + count noise) / 5
    src = SecureGaussian.replay(1234, "test")
    src.sample(4, 1.0, np.float32)  # the update noise is drawn first
    share = (5 + float(src.sample((), 0.2, np.float64))) / 5
    assert down[1] == pytest.approx(50.0 * math.exp(-0.2 * (share - 0.5)), rel=1e-6)


def test_adaptive_noise_split_and_its_limit():
    s = ClientDP(noise_multiplier=1.0, adaptive=1)
    z_d = s.update_noise_multiplier(20)  # sigma_b = 1
    assert z_d == pytest.approx((1 - 0.25) ** -0.5)
    assert z_d > 1.0  # the update gets more noise than z: the count query takes part of the budget
    with pytest.raises(ValueError, match=r"count noise sigma_b > noise_multiplier / 2 = 1.25"):
        ClientDP(noise_multiplier=2.5, adaptive=1).update_noise_multiplier(20)
    assert ClientDP(noise_multiplier=2.5, adaptive=1, count_noise=2.0).update_noise_multiplier(3) > 2.5


def test_state_survives_a_restart_and_accounting_composes_rounds(seeded):
    s = ClientDP(clip_norm=1.0, noise_multiplier=1.1, adaptive=1, count_noise=1.0)
    g = {"w": np.zeros(8, np.float32)}
    for _ in range(3):
        _round(s, [{"w": np.ones(8, np.float32) * k} for k in (1, 2, 3)], g)
    fresh = ClientDP(clip_norm=1.0, noise_multiplier=1.1, adaptive=1, count_noise=1.0)
    fresh.load_state(s.state())
    assert fresh.clip_norm == s.clip_norm != 1.0 and fresh.rounds_done == 3
    assert fresh.epsilon() == pytest.approx(epsilon_of([(1.1, 1.0, 3)], 1e-5))
    assert fresh.epsilon(10) > fresh.epsilon()
    assert make_strategy("dp-fedavg").needs_per_site_updates  # central DP cannot run on a masked sum


@pytest.mark.parametrize("params, match", [({"noise_multiplier": 0.0}, "protects nothing"),
                                           ({"clip_norm": -1.0}, "clip_norm"),
                                           ({"target_quantile": 1.0}, "target_quantile"),
                                           ({"adaptive": 2.0}, "adaptive")])
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ConfigError, match=match):
        make_strategy("dp-fedavg", params)


def test_watch_line_shows_the_privacy_spend():
    from fedclinic.client import _headline

    assert _headline({"eval_accuracy": 0.5, "dp_epsilon": 3.14159, "dp_delta": 1e-5}) == \
        " site-eval acc 0.500 eps 3.14 (delta 1e-05)"
    assert _headline({"client_dp_epsilon": 2.0}) == " client-DP eps 2.00"
    assert _headline({"eval_accuracy": 0.5}) == " site-eval acc 0.500"
