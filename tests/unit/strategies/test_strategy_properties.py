"""Every registered strategy against a direct, non-streaming numpy reference on random inputs, plus invariants.

The references are written from the formulas in each strategy's docstring, in float64, without blocks,
online softmax or spill files; the strategies run with tiny blocks so the streaming paths are exercised.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.strategies import STRATEGIES, FedAtt, make_strategy
from fedclinic.strategies.tensorsource import FileTensor


def _softmax(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def _ref_fedavg(g, ds, w, p):
    return g + p.get("server_lr", 1.0) * sum(wi * d for wi, d in zip(w, ds)) / sum(w)


def _ref_fedatt(g, ds, w, p):
    lam, t = p.get("server_lr", 1.2), p.get("temperature", 1.0)
    s = np.array([np.linalg.norm(d) for d in ds]) / t
    a = _softmax(s)
    return g + lam * sum(ai * d for ai, d in zip(a, ds))


def _ref_dynamic(g, ds, w, p):
    c = [sum(np.linalg.norm(d) for d in [dk]) for dk in ds]  # one tensor: sum over tensors = its norm
    return g + p.get("server_lr", 1.0) * sum(ci * d for ci, d in zip(c, ds)) / (sum(c) + 1e-7)


def _ref_weipro(g, ds, w, p):
    """First round (phi = 1 everywhere): rho from the given weights, projections on R, alpha from |p|."""
    rho = np.asarray(w, dtype=np.float64) / np.sum(w)
    r = sum(ri * d for ri, d in zip(rho, ds))
    proj = np.array([np.dot(d, r) for d in ds]) / np.linalg.norm(r)
    alpha = np.abs(proj) / np.abs(proj).sum()
    return g + sum(a * d for a, d in zip(alpha, ds))


def _ref_median(g, ds, w, p):
    return g + np.median(np.stack(ds), axis=0)


def _ref_trimmed(g, ds, w, p):
    k = math.floor(p.get("beta", 0.2) * len(ds))
    s = np.sort(np.stack(ds), axis=0)
    return g + s[k:len(ds) - k].mean(axis=0)


def _ref_norm_bounded(g, ds, w, p):
    c = p.get("max_norm", 1.0)
    scaled = [d * min(1.0, c / np.linalg.norm(d)) if np.linalg.norm(d) > 0 else d for d in ds]
    return _ref_fedavg(g, scaled, w, {})


def _ref_client_dp(g, ds, w, p):
    """dp-fedavg with its noise switched off (see _no_dp_noise): clipped updates, equal weights."""
    return _ref_norm_bounded(g, ds, np.ones(len(ds)), {"max_norm": p.get("clip_norm", 1.0)})


def _ref_krum(g, ds, w, p):
    n, f = len(ds), p.get("byzantine", 1)
    dist = np.array([[np.sum((a - b) ** 2) for b in ds] for a in ds])
    scores = [np.sort(np.delete(dist[i], i))[:n - f - 2].sum() for i in range(n)]
    keep = sorted(np.argsort(scores, kind="stable")[:n - f])
    return _ref_fedavg(g, [ds[i] for i in keep], [w[i] for i in keep], {})


def _ref_fedopt(kind):
    def ref(g, ds, w, p):
        eta, b1, b2, tau = p.get("server_lr", 1e-2), 0.9, 0.99, 1e-3
        delta = _ref_fedavg(np.zeros_like(g), ds, w, {})
        if kind == "fedavgm":
            return g + p.get("server_lr", 1.0) * delta  # first round: v = Delta
        m = (1 - b1) * delta
        v0 = tau ** 2
        sq = delta ** 2
        v = {"fedadagrad": v0 + sq, "fedadam": b2 * v0 + (1 - b2) * sq,
             "fedyogi": v0 - (1 - b2) * sq * np.sign(v0 - sq)}[kind]
        return g + eta * m / (np.sqrt(v) + tau)
    return ref


REFERENCES = {
    "fedavg": ({"server_lr": 0.7}, _ref_fedavg),
    "fedatt": ({"server_lr": 4.0}, _ref_fedatt),
    "dynamic-weighting": ({}, _ref_dynamic),
    "median": ({}, _ref_median),
    "weipro": ({}, _ref_weipro),
    "trimmed-mean": ({"beta": 0.2}, _ref_trimmed),
    "norm-bounded": ({"max_norm": 2.0}, _ref_norm_bounded),
    "dp-fedavg": ({"clip_norm": 2.0, "noise_multiplier": 1.0}, _ref_client_dp),
    "multi-krum": ({"byzantine": 1}, _ref_krum),
    "fedavgm": ({}, _ref_fedopt("fedavgm")),
    "fedadagrad": ({}, _ref_fedopt("fedadagrad")),
    "fedadam": ({}, _ref_fedopt("fedadam")),
    "fedyogi": ({}, _ref_fedopt("fedyogi")),
}


def test_every_strategy_has_a_reference():
    assert set(REFERENCES) == set(STRATEGIES)


def _run(name, params, g, ds, w, order=None, files=None):
    s = make_strategy(name, params)
    if hasattr(s, "_scratch"):
        s._scratch = np.empty(7, np.float32)  # many blocks
    if hasattr(s, "_BLOCK_ELEMS"):
        s._BLOCK_ELEMS = 5
    s.begin({"w": g})
    for i in order if order is not None else range(len(ds)):
        s.accept({"w": files[i] if files else ds[i]}, float(w[i]), site=f"s{i}")
    return s.finalize()["w"]


class _ZeroNoise:
    def sample(self, shape, std, dtype=np.float32):
        return np.zeros(shape, dtype)


@pytest.fixture(autouse=True)
def _no_dp_noise(monkeypatch):
    """The aggregation math of dp-fedavg is compared with its reference without noise
    (tests/unit/strategies/test_client_dp checks the noise itself)."""
    from fedclinic.strategies import client_dp

    monkeypatch.setattr(client_dp, "_noise_source", _ZeroNoise)


sites_st = st.integers(5, 8)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@settings(max_examples=25, deadline=None)
@given(n=sites_st, size=st.integers(1, 40), seed=st.integers(0, 10_000), scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_matches_direct_reference(name, n, size, seed, scale):
    params, ref = REFERENCES[name]
    rng = np.random.default_rng(seed)
    g = rng.normal(size=size).astype(np.float32)
    ds = [(rng.normal(size=size) * scale * rng.uniform(0.2, 2)).astype(np.float32) for _ in range(n)]
    w = rng.integers(1, 100, size=n).astype(float)
    got = _run(name, params, g, ds, w)
    want = ref(g.astype(np.float64), [d.astype(np.float64) for d in ds], w, params)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * max(1.0, scale))


@pytest.mark.parametrize("name", sorted(REFERENCES))
@settings(max_examples=15, deadline=None)
@given(n=sites_st, seed=st.integers(0, 10_000))
def test_permutation_invariant(name, n, seed):
    params, _ = REFERENCES[name]
    rng = np.random.default_rng(seed)
    g = rng.normal(size=12).astype(np.float32)
    ds = [rng.normal(size=12).astype(np.float32) for _ in range(n)]
    w = rng.integers(1, 100, size=n).astype(float)
    a = _run(name, params, g, ds, w)
    b = _run(name, params, g, ds, w, order=list(rng.permutation(n)))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedatt", "median", "trimmed-mean", "norm-bounded", "multi-krum",
                                  "dynamic-weighting", "weipro"])
@settings(max_examples=15, deadline=None)
@given(n=sites_st, seed=st.integers(0, 10_000))
def test_identical_updates_aggregate_to_themselves(name, n, seed):
    """With a unit step, n copies of one small update move the model by exactly that update."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=9).astype(np.float32)
    d = (rng.normal(size=9) * 0.1).astype(np.float32)
    params = {"server_lr": 1.0} if name in ("fedavg", "fedatt") else {}
    if name == "norm-bounded":
        params = {"max_norm": 10.0}
    out = _run(name, params, g, [d] * n, rng.integers(1, 9, size=n).astype(float))
    np.testing.assert_allclose(out, g + d, rtol=1e-5, atol=1e-6)


def test_streaming_from_spill_files_equals_arrays(tmp_path):
    rng = np.random.default_rng(3)
    g = rng.normal(size=(6, 5)).astype(np.float32)
    ds = [rng.normal(size=g.shape).astype(np.float32) for _ in range(5)]
    path = tmp_path / "spill.bin"
    path.write_bytes(b"".join(d.tobytes() for d in ds))
    files = [FileTensor(path, i * ds[0].nbytes, "float32", g.shape) for i in range(5)]
    w = [3.0, 1.0, 4.0, 1.0, 5.0]
    for name, (params, _) in sorted(REFERENCES.items()):
        np.testing.assert_allclose(_run(name, params, g, ds, w, files=files), _run(name, params, g, ds, w),
                                   rtol=1e-6, atol=1e-6, err_msg=name)


# ---- FedAtt specifics -------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 7), seed=st.integers(0, 10_000), temperature=st.sampled_from([0.01, 1.0, 5.0]))
def test_fedatt_weights_sum_to_one_and_favour_the_farthest_site(n, seed, temperature):
    rng = np.random.default_rng(seed)
    g = {"a": np.zeros(4, np.float32), "b": np.zeros((2, 3), np.float32)}
    s = FedAtt(temperature=temperature)
    s.begin(g)
    for i in range(n):
        s.accept({k: (rng.normal(size=v.shape) * (i + 1)).astype(np.float32) for k, v in g.items()}, 1.0, site=f"s{i}")
    alpha = s.weights()
    for tensor in g:
        col = [alpha[f"s{i}"][tensor] for i in range(n)]
        assert math.isclose(sum(col), 1.0, rel_tol=1e-9)
        assert all(0 <= a <= 1 for a in col)


def test_fedatt_softmax_is_over_distance_not_similarity():
    """Exactly as FLCMC Eq. 12: exp(+||d_k||), so the site farthest from the server weighs most."""
    g = {"w": np.zeros(1, np.float32)}
    s = FedAtt(server_lr=1.0)
    s.begin(g)
    s.accept({"w": np.array([1.0], np.float32)}, 100.0, site="near")
    s.accept({"w": np.array([3.0], np.float32)}, 1.0, site="far")
    a = s.weights()
    assert a["far"]["w"] > a["near"]["w"]
    expected = (math.e * 1 + math.e ** 3 * 3) / (math.e + math.e ** 3)  # sample counts ignored
    np.testing.assert_allclose(s.finalize()["w"], [expected], rtol=1e-6)


def test_fedatt_huge_distances_do_not_overflow():
    g = {"w": np.zeros(3, np.float32)}
    s = FedAtt(server_lr=1.0)
    s.begin(g)
    for i, scale in enumerate([1e3, 5e3, 2e3]):
        s.accept({"w": np.full(3, scale, np.float32)}, 1.0, site=f"s{i}")
    out = s.finalize()["w"]
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, np.full(3, 5e3), rtol=1e-6)


def test_fedatt_per_layer_and_whole_model_differ():
    g = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    u1 = {"a": np.array([2.0, 0], np.float32), "b": np.array([0.0, 0.1], np.float32)}
    u2 = {"a": np.array([0.0, 0.1], np.float32), "b": np.array([2.0, 0], np.float32)}
    outs = {}
    for gran in ("per_layer", "whole_model"):
        s = FedAtt(server_lr=1.0, granularity=gran)
        s.begin(g)
        s.accept(u1, 1, site="x")
        s.accept(u2, 1, site="y")
        outs[gran] = s.finalize()
    # per layer the big tensor of each site dominates that tensor; whole-model the two sites tie (same norm)
    assert outs["per_layer"]["a"][0] > 1.5
    np.testing.assert_allclose(outs["whole_model"]["a"], [1.0, 0.05], rtol=1e-6)


def test_fedatt_spectral_norm_uses_largest_singular_value():
    g = {"w": np.zeros((2, 2), np.float32)}
    d1 = np.diag([3.0, 0.0]).astype(np.float32)    # frobenius 3, spectral 3
    d2 = np.diag([2.0, 2.0]).astype(np.float32)    # frobenius 2.83, spectral 2
    s = FedAtt(server_lr=1.0, norm="spectral")
    s.begin(g)
    s.accept({"w": d1}, 1, site="a")
    s.accept({"w": d2}, 1, site="b")
    a = s.weights()
    assert math.isclose(a["a"]["w"], math.e ** 3 / (math.e ** 3 + math.e ** 2), rel_tol=1e-9)


@pytest.mark.parametrize("params, match", [
    ({"server_lr": 0}, "server_lr"), ({"temperature": -1}, "temperature"), ({"granularity": "layer"}, "granularity"),
    ({"norm": "l1"}, "norm"), ({"norm": "spectral", "granularity": "whole_model"}, "spectral"),
])
def test_fedatt_bad_parameters(params, match):
    from fedclinic.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        make_strategy("fedatt", params)


# ---- dynamic weighting (IU-CXR) ---------------------------------------------------------------------------


def test_dynamic_weighting_report_definition_sums_per_tensor_norms_and_ignores_sample_counts():
    g = {"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
    s = make_strategy("dynamic-weighting")
    s.begin(g)
    s.accept({"a": np.array([3.0, 4.0], np.float32), "b": np.array([1.0], np.float32)}, 1000.0, site="x")  # c = 5 + 1
    s.accept({"a": np.array([0.0, 2.0], np.float32), "b": np.array([-2.0], np.float32)}, 1.0, site="y")   # c = 2 + 2
    assert s.contributions == {"x": 6.0, "y": 4.0}
    out = s.finalize()
    np.testing.assert_allclose(out["a"], (6 * np.array([3, 4]) + 4 * np.array([0, 2])) / (10 + 1e-7), rtol=1e-6)
    np.testing.assert_allclose(out["b"], [(6 * 1 + 4 * -2) / 10], rtol=1e-6)


def test_dynamic_weighting_code_definition_uses_the_reported_rate():
    from fedclinic.errors import IntegrityError

    s = make_strategy("dynamic-weighting", {"definition": "code"})
    assert s.site_metrics() == ("gradient_change_rate",)
    with pytest.raises(IntegrityError, match="measure_gradient_change = true"):
        s.weight_for(10, {"train_loss": 1.0})
    with pytest.raises(IntegrityError, match="gradient_change_rate"):
        s.weight_for(10, {"gradient_change_rate": float("nan")})
    g = {"w": np.zeros(2, np.float32)}
    s.begin(g)
    s.accept({"w": np.array([1.0, 0], np.float32)}, s.weight_for(5, {"gradient_change_rate": 3.0}), site="x")
    s.accept({"w": np.array([0, 1.0], np.float32)}, s.weight_for(500, {"gradient_change_rate": 1.0}), site="y")
    np.testing.assert_allclose(s.finalize()["w"], [0.75, 0.25], rtol=1e-6)


def test_task_validation_requires_measured_gradients_for_the_code_definition():
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused
    from fedclinic.transport.package import ModelPackage
    from fedclinic.spec.task import Task

    manifest = ModelPackage({"w": np.zeros(2, np.float32)}).manifest()
    kw = dict(name="k", dataset="d", labels=["a", "b"], strategy="dynamic-weighting",
              strategy_params={"definition": "code"})
    with pytest.raises(Refused, match="set training.measure_gradient_change = true"):
        validate_spec(Task(**kw).to_spec(), manifest)
    validate_spec(Task(**kw, measure_gradient_change=True).to_spec(), manifest)


# ---- WeiPro (CancersQA) -------------------------------------------------------------------------------------


def test_weipro_alpha_sums_to_one_and_phi_counts_rounds_joined_across_saved_state():
    g = {"w": np.zeros(3, np.float32)}
    d = {"a": np.array([1.0, 0, 0], np.float32), "b": np.array([0.0, 1.0, 0], np.float32)}
    s = make_strategy("weipro")
    s.begin(g)
    s.accept({"w": d["a"]}, 1.0, site="a")
    s.finalize()
    assert s.alpha == {"a": 1.0}
    state = s.state()
    # round 2: a has joined twice (phi 2), b once, equal losses -> rho = (2/3, 1/3)
    s2 = make_strategy("weipro")
    s2.load_state(state)
    s2.begin(g)
    s2.accept({"w": d["a"]}, 1.0, site="a")
    s2.accept({"w": d["b"]}, 1.0, site="b")
    out = s2.finalize()["w"]
    # R = (2/3, 1/3, 0); p = (2/3, 1/3) / |R|; alpha = (2/3, 1/3)
    np.testing.assert_allclose(out, [2 / 3, 1 / 3, 0], rtol=1e-6)
    assert math.isclose(sum(s2.alpha.values()), 1.0)
    assert {k: float(v[0]) for k, v in s2.state().items()} == {"phi/a": 2.0, "phi/b": 1.0}


def test_weipro_reference_weights_come_from_the_reported_loss():
    from fedclinic.errors import IntegrityError

    s = make_strategy("weipro")
    assert s.weight_for(100, {"train_loss": 0.5, "steps": 8}) == 4.0          # sum of batch losses, n = GPUs = 1
    assert make_strategy("weipro", {"n_mode": "samples", "loss_reduction": "mean"}).weight_for(
        100, {"train_loss": 0.5}) == 50.0
    with pytest.raises(IntegrityError, match="train_loss"):
        s.weight_for(100, {})
    relu = make_strategy("weipro", {"z": "relu"})
    relu.begin({"w": np.zeros(2, np.float32)})
    relu.accept({"w": np.array([1.0, 0], np.float32)}, 3.0, site="x")
    relu.accept({"w": np.array([-1.0, 0.1], np.float32)}, 1.0, site="y")   # points against the reference
    relu.finalize()
    assert relu.alpha["y"] < 1e-9 and relu.alpha["x"] > 0.999999
