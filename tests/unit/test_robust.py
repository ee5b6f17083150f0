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
