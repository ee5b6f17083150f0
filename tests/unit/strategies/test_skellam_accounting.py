"""Accounting of the distributed Skellam mechanism: golden values of the reference implementation, the RDP-to-DP
conversion shared with Opacus, the sensitivity bounds and the planner.

Golden values: ``skellam_epsilon(scale, central_stddev, l2_sens, beta, dim, q=1, steps, delta)`` of
google-research/federated ``distributed_dp/accounting_utils.py`` (commit a5af8c4, Feb 2024), run unmodified with its
``tensorflow_privacy.get_privacy_spent`` provided by Opacus' ``get_privacy_spent`` (the same Balle et al. 2020
conversion). Their ``central_stddev`` is in update units, so our integer-domain variance is ``(scale * stddev)^2``.
"""

from __future__ import annotations

import math

import pytest

from fedclinic.errors import ConfigError
from fedclinic.strategies.dp_accounting import epsilon_from_rdp
from fedclinic.strategies.skellam_accounting import (RDP_ORDERS, SkellamSensitivity, auto_scale, plan_site_variance,
                                                     rounded_l1_bound, rounded_l2_bound, skellam_rdp)

BETA = math.exp(-0.5)
GOLDEN = [  # scale, stddev (update units), clip C, beta, dim, rounds, delta -> epsilon (reference)
    (1024.0, 10.0, 1.0, BETA, 1000, 100, 1e-5, 4.755803508731002),
    (64.0, 2.0, 0.5, BETA, 4096, 10, 1e-6, 6.051325903059972),
    (8.0, 40.0, 1.0, BETA, 10000, 20, 1e-5, 3.232758440398775),   # coarse grid: rounding dominates the sensitivity
    (4096.0, 3.0, 2.0, 0.0, 100, 1, 1e-5, 2.99622988356667),      # beta 0: the plain c + sqrt(d) bound
    (0.5, 30.0, 1.0, BETA, 100, 5, 1e-5, 3.824819049761888),      # scale < 1: the discretisation term matters
]


@pytest.mark.parametrize("scale,stddev,clip,beta,dim,rounds,delta,want", GOLDEN)
def test_epsilon_matches_the_reference_implementation(scale, stddev, clip, beta, dim, rounds, delta, want):
    sens = SkellamSensitivity(clip, scale, dim, beta)
    assert sens.epsilon([(scale * stddev) ** 2] * rounds, delta) == pytest.approx(want, rel=1e-12)


def test_the_conversion_is_opacus():
    from opacus.accountants.analysis.rdp import get_privacy_spent

    rdp = SkellamSensitivity(1.0, 256.0, 500).rdp([3e5] * 7)
    ours = epsilon_from_rdp(RDP_ORDERS, rdp, 1e-6)
    theirs = get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=1e-6)
    assert ours[0] == pytest.approx(float(theirs[0]), rel=1e-13) and ours[1] == theirs[1]


def test_sensitivity_bounds():
    assert rounded_l2_bound(3.0, 16, 0.0) == 3.0 + 4.0
    c, d = 100.0, 400
    squared = c * c + d / 4 + math.sqrt(2 * math.log(1 / BETA)) * (c + math.sqrt(d) / 2)
    assert rounded_l2_bound(c, d, BETA) == pytest.approx(math.sqrt(squared))
    assert rounded_l1_bound(5.0, 400) == 25.0 and rounded_l1_bound(50.0, 400) == 50.0 * 20.0
    with pytest.raises(ConfigError):
        rounded_l2_bound(1.0, 10, 1.0)


def test_rdp_approaches_the_gaussian_mechanism_for_large_variance():
    # alpha Delta^2 / (2 mu) is the Gaussian's RDP; the discretisation surcharge vanishes as mu grows
    for mu in (1e6, 1e9):
        assert skellam_rdp(8, 1e3, 100.0, mu) == pytest.approx(8 * 1e4 / (2 * mu), rel=1e-3)
    assert skellam_rdp(8, 1e3, 100.0, 0.0) == math.inf


def test_rounds_compose_and_more_noise_spends_less():
    sens = SkellamSensitivity(1.0, 1024.0, 1000)
    one, three = sens.epsilon([4e6], 1e-5), sens.epsilon([4e6] * 3, 1e-5)
    assert one < three < 3 * one
    assert sens.epsilon([4e6, 8e6], 1e-5) < sens.epsilon([4e6, 4e6], 1e-5)  # a round with more survivors
    assert sens.epsilon([], 1e-5) == 0.0


def test_the_planner_meets_the_target_at_the_fewest_survivors():
    kw = dict(clip_norm=1.0, scale=auto_scale(1.0, 5000), dim=5000, rounds=10, delta=1e-5)
    mu3 = plan_site_variance(min_survivors=3, target_epsilon=2.0, **kw)
    sens = SkellamSensitivity(1.0, kw["scale"], 5000)
    eps = sens.epsilon([3 * mu3] * 10, 1e-5)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=1e-6)
    assert sens.epsilon([3.01 * mu3] * 10, 1e-5) < 2.0 < sens.epsilon([2.99 * mu3] * 10, 1e-5)
    assert plan_site_variance(min_survivors=6, target_epsilon=2.0, **kw) == pytest.approx(mu3 / 2, rel=1e-12)
    z = plan_site_variance(min_survivors=4, noise_multiplier=1.5, **kw)
    assert 4 * z == pytest.approx((1.5 * sens.l2) ** 2)
    with pytest.raises(ConfigError, match="target_epsilon or noise_multiplier"):
        plan_site_variance(min_survivors=3, **kw)


def test_auto_scale_is_a_power_of_two_step_above_32_sqrt_d():
    gamma = auto_scale(0.5, 10_000)  # 32 * 100 = 3200 -> 4096
    assert gamma * 0.5 == 4096.0
