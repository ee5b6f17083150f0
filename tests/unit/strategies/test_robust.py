"""Robust strategies against numpy, with an outlier site, in memory and from spill files."""

import numpy as np
import pytest

from fedclinic.strategies import make_strategy
from fedclinic.strategies.tensorsource import FileTensor


def _run(kind, params, x, deltas, weights):
    s = make_strategy(kind, params)
    s.begin({"w": x})
    for i, (d, w) in enumerate(zip(deltas, weights)):
        s.accept({"w": d}, w, site=f"s{i}")
    return s.finalize()["w"]


@pytest.fixture
def sites():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(50, 30)).astype(np.float32)
    deltas = [rng.normal(scale=0.01, size=x.shape).astype(np.float32) for _ in range(5)]
    deltas[2] = np.full(x.shape, 1e3, np.float32)  # a poisoned site
    return x, deltas, [10.0, 20.0, 30.0, 40.0, 50.0]


def test_median_ignores_an_outlier(sites):
    x, deltas, w = sites
    out = _run("median", {}, x, deltas, w)
    np.testing.assert_allclose(out, x + np.median(np.stack(deltas), axis=0), rtol=1e-6, atol=1e-6)
    assert np.abs(out - x).max() < 0.1


def test_trimmed_mean(sites):
    x, deltas, w = sites
    out = _run("trimmed-mean", {"beta": 0.2}, x, deltas, w)
    s = np.sort(np.stack(deltas), axis=0)[1:4]
    np.testing.assert_allclose(out, x + s.mean(axis=0), rtol=1e-5, atol=1e-6)


def test_norm_bounding_scales_large_updates(sites):
    x, deltas, w = sites
    c = 0.5
    out = _run("norm-bounded", {"max_norm": c}, x, deltas, w)
    scaled = [d * min(1.0, c / np.linalg.norm(d.astype(np.float64))) for d in deltas]
    expected = x + sum(wi * d for wi, d in zip(w, scaled)) / sum(w)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_median_reads_spill_files_blockwise(tmp_path, sites):
    x, deltas, w = sites
    path = tmp_path / "spill.bin"
    path.write_bytes(b"".join(d.tobytes() for d in deltas))
    files = [FileTensor(path, i * deltas[0].nbytes, "float32", x.shape) for i in range(len(deltas))]
    s = make_strategy("median")
    s._BLOCK_ELEMS = 64  # many blocks
    s.begin({"w": x})
    for i, f in enumerate(files):
        s.accept({"w": f}, w[i], site=f"s{i}")
    np.testing.assert_allclose(s.finalize()["w"], x + np.median(np.stack(deltas), axis=0), rtol=1e-6, atol=1e-6)


def test_robust_parameters_are_validated():
    from fedclinic.errors import ConfigError

    with pytest.raises(ConfigError, match="beta must be in"):
        make_strategy("trimmed-mean", {"beta": 0.5})
    with pytest.raises(ConfigError, match="max_norm must be > 0"):
        make_strategy("norm-bounded", {"max_norm": 0})
    assert make_strategy("median").needs_per_site_updates


def _krum_reference(deltas, weights, f, m):
    n = len(deltas)
    flat = [d.reshape(-1).astype(np.float64) for d in deltas]
    dist = np.array([[np.sum((a - b) ** 2) for b in flat] for a in flat])
    scores = [np.sort(np.delete(dist[i], i))[:n - f - 2].sum() for i in range(n)]
    chosen = sorted(np.argsort(scores, kind="stable")[:m])
    w = np.array([weights[i] for i in chosen])
    return chosen, sum(wi * deltas[i] for wi, i in zip(w / w.sum(), chosen))


def test_multi_krum_drops_the_poisoned_site(sites):
    x, deltas, w = sites
    s = make_strategy("multi-krum", {"byzantine": 1})
    s.begin({"w": x})
    for i, (d, wi) in enumerate(zip(deltas, w)):
        s.accept({"w": d}, wi, site=f"s{i}")
    out = s.finalize()["w"]
    chosen, mean = _krum_reference(deltas, w, f=1, m=4)
    assert s.selected == chosen and 2 not in s.selected
    np.testing.assert_allclose(out, x + mean, rtol=1e-5, atol=1e-6)


def test_multi_krum_needs_enough_sites_and_same_tensors(sites):
    from fedclinic.errors import IntegrityError

    x, deltas, w = sites
    s = make_strategy("multi-krum", {"byzantine": 1})
    s.begin({"w": x, "b": np.zeros(3, np.float32)})
    for i in range(4):
        s.accept({"w": deltas[i]}, 1.0, site=f"s{i}")
    with pytest.raises(IntegrityError, match="needs at least 5 updates, got 4"):
        s.finalize()
    s.begin({"w": x, "b": np.zeros(3, np.float32)})
    s.accept({"w": deltas[0]}, 1.0, site="a")
    with pytest.raises(IntegrityError, match="same tensors"):
        s.accept({"w": deltas[1], "b": np.zeros(3, np.float32)}, 1.0, site="b")


def test_task_validation_checks_the_strategy_minimum():
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused
    from fedclinic.transport.package import ModelPackage
    from fedclinic.spec.task import Task

    spec = Task(name="k", dataset="d", labels=["a", "b"], min_sites=3, strategy="multi-krum",
                strategy_params={"byzantine": 1}).to_spec()
    with pytest.raises(Refused, match="needs at least 5 updates per round; raise rounds.min_sites"):
        validate_spec(spec, ModelPackage({"w": np.zeros(2, np.float32)}).manifest())
