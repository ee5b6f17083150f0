"""Server optimizers against direct transcriptions of their formulas, over rounds, through saved state."""

import numpy as np
import pytest

from fedclinic.strategies import make_strategy


def _reference(kind, rounds_deltas, x0, eta, beta1=0.9, beta2=0.99, tau=1e-3, momentum=0.9):
    x, m, v = x0.astype(np.float64), np.zeros_like(x0, np.float64), np.full_like(x0, tau ** 2, np.float64)
    vm = np.zeros_like(x0, np.float64)
    for d in rounds_deltas:
        d = d.astype(np.float64)
        if kind == "fedavgm":
            vm = momentum * vm + d
            x = x + eta * vm
            continue
        m = beta1 * m + (1 - beta1) * d
        if kind == "fedadagrad":
            v = v + d ** 2
        elif kind == "fedadam":
            v = beta2 * v + (1 - beta2) * d ** 2
        else:
            v = v - (1 - beta2) * d ** 2 * np.sign(v - d ** 2)
        x = x + eta * m / (np.sqrt(v) + tau)
    return x


@pytest.mark.parametrize("kind, eta", [("fedavgm", 0.5), ("fedadagrad", 0.05), ("fedadam", 0.05),
                                       ("fedyogi", 0.05)])
def test_server_optimizer_matches_formula_across_rounds_with_saved_state(kind, eta):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    x0 = x.copy()
    means = []
    state: dict = {}
    for _ in range(3):
        site_deltas = [rng.normal(scale=0.1, size=x.shape).astype(np.float32) for _ in range(3)]
        weights = [5.0, 10.0, 25.0]
        means.append(sum(w * d for w, d in zip(weights, site_deltas)) / sum(weights))
        s = make_strategy(kind, {"server_lr": eta})  # a fresh object each round, as the aggregator does
        s.load_state(state)
        s.begin({"w": x})
        for i, (w, d) in enumerate(zip(weights, site_deltas)):
            s.accept({"w": d}, w, site=f"s{i}")
        x = s.finalize()["w"].copy()
        state = {k: v.copy() for k, v in s.state().items()}
    np.testing.assert_allclose(x, _reference(kind, means, x0, eta), rtol=2e-4, atol=2e-5)
    assert state  # the moments are carried as state


def test_stateless_strategy_refuses_state():
    with pytest.raises(ValueError, match="keeps no state"):
        make_strategy("fedavg").load_state({"m/w": np.zeros(2, np.float32)})


def test_fedopt_parameters_are_validated():
    from fedclinic.errors import ConfigError

    with pytest.raises(ConfigError, match="bad parameters"):
        make_strategy("fedadam", {"momentum": 0.9})
