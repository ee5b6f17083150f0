import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.spec.selection import select_names
from fedclinic.strategies import FedAvg, make_strategy
from fedclinic.strategies.fedavg import weighted_add


@settings(max_examples=40, deadline=None)
@given(n_sites=st.integers(1, 6), size=st.integers(1, 3000), seed=st.integers(0, 10_000))
def test_fedavg_equals_direct_weighted_mean(n_sites, size, seed):
    rng = np.random.default_rng(seed)
    g = {"w": rng.normal(size=size).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    deltas = [{"w": rng.normal(size=size).astype(np.float32)} for _ in range(n_sites)]
    weights = rng.integers(1, 100, size=n_sites)
    s = FedAvg()
    s.begin(g)
    for i, (d, w) in enumerate(zip(deltas, weights)):
        s.accept(d, float(w), site=f"s{i}")
    out = s.finalize()
    expected = g["w"] + sum(w * d["w"] for d, w in zip(deltas, weights)) / weights.sum()
    np.testing.assert_allclose(out["w"], expected, rtol=1e-5, atol=1e-5)
    assert "b" not in out  # a tensor no site sent stays as it was


def test_tensor_averaged_over_the_sites_that_sent_it():
    g = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    s = FedAvg()
    s.begin(g)
    s.accept({"a": np.ones(2, np.float32)}, 1, site="x")
    s.accept({"a": 3 * np.ones(2, np.float32), "b": np.ones(2, np.float32)}, 1, site="y")
    out = s.finalize()
    assert out["a"].tolist() == [2, 2] and out["b"].tolist() == [1, 1]


def test_weighted_add_blocks_match_numpy():
    rng = np.random.default_rng(0)
    acc, x = rng.normal(size=700_001).astype(np.float32), rng.normal(size=700_001).astype(np.float32)
    expected = acc + np.float32(0.3) * x
    weighted_add(acc, x, 0.3, np.empty(1000, np.float32))
    np.testing.assert_allclose(acc, expected, rtol=1e-6)


def test_bad_updates_are_refused():
    s = FedAvg()
    s.begin({"a": np.zeros(2, np.float32)})
    with pytest.raises(IntegrityError, match="shape"):
        s.accept({"a": np.zeros(3, np.float32)}, 1, site="x")
    with pytest.raises(IntegrityError, match="unknown tensor"):
        s.accept({"z": np.zeros(2, np.float32)}, 1, site="x")
    with pytest.raises(IntegrityError, match="weight"):
        s.accept({"a": np.zeros(2, np.float32)}, 0, site="x")


def test_make_strategy_errors():
    with pytest.raises(ConfigError, match="unknown strategy"):
        make_strategy("fedmagic")
    with pytest.raises(ConfigError, match="bad parameters"):
        make_strategy("fedavg", {"nope": 1.0})


def test_selection_patterns():
    names = ["bert.embeddings.w", "bert.encoder.layer.4.w", "bert.encoder.layer.5.w", "classifier.weight"]
    assert select_names(names, [r"bert\.encoder\.layer\.[45]\..*", r"classifier\..*"]) == names[1:]
    assert select_names(names, frozen=[r"bert\..*"]) == ["classifier.weight"]
    with pytest.raises(ConfigError, match="matches no tensor"):
        select_names(names, ["nothing"])
    with pytest.raises(ConfigError, match="no tensor is left"):
        select_names(names, private=[".*"])
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        select_names(names, ["("])


def test_fedavg_reads_file_tensors_blockwise(tmp_path):
    from fedclinic.strategies.tensorsource import FileTensor

    rng = np.random.default_rng(1)
    g = rng.normal(size=(300, 7)).astype(np.float32)
    d1, d2 = (rng.normal(size=(300, 7)).astype(np.float32) for _ in range(2))
    (tmp_path / "g.bin").write_bytes(g.tobytes())
    (tmp_path / "u.bin").write_bytes(b"\0" * 12 + d1.tobytes() + d2.tobytes())
    s = FedAvg()
    s._scratch = np.empty(64, np.float32)  # force many blocks
    s.begin({"w": FileTensor(tmp_path / "g.bin", 0, "float32", (300, 7))})
    s.accept({"w": FileTensor(tmp_path / "u.bin", 12, "float32", (300, 7))}, 1.0, site="a")
    s.accept({"w": FileTensor(tmp_path / "u.bin", 12 + d1.nbytes, "float32", (300, 7))}, 3.0, site="b")
    np.testing.assert_allclose(s.finalize()["w"], g + (d1 + 3 * d2) / 4, rtol=1e-5, atol=1e-6)


def test_refused_update_leaves_the_accumulator_unchanged():
    """Strategy contract: refuse before changing state (the aggregator folds before it records)."""
    g = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    s = FedAvg()
    s.begin(g)
    with pytest.raises(IntegrityError, match="shape"):
        s.accept({"a": np.ones(2, np.float32), "b": np.ones(5, np.float32)}, 1, site="bad")
    s.accept({"a": np.full(2, 4, np.float32)}, 1, site="good")
    out = s.finalize()
    assert out["a"].tolist() == [4, 4] and "b" not in out
