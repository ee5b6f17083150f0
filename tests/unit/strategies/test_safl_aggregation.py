"""Per-tensor aggregation of partial updates (SAFL): each tensor is averaged over the sites that sent it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fedclinic.strategies import STRATEGIES, make_strategy

SHAPES = {"layer.0.w": (3, 2), "layer.1.w": (4,), "layer.2.w": (2, 2), "head.w": (3,)}


def _run(name, global_tensors, updates, params=None):
    s = make_strategy(name, params)
    s.begin(global_tensors)
    for i, (update, weight) in enumerate(updates):
        s.accept(update, weight, site=f"site-{i}")
    return s.finalize()


def test_a_site_that_did_not_send_a_tensor_does_not_dilute_its_average():
    g = {"x": np.zeros(2, np.float32), "y": np.zeros(2, np.float32)}
    out = _run("fedavg", g, [({"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)}, 10.0),
                             ({"y": np.full(2, 4.0, np.float32)}, 30.0)])
    np.testing.assert_allclose(out["x"], [1.0, 1.0])           # only site 0 sent x: its delta, not 10/40 of it
    np.testing.assert_allclose(out["y"], [(10 * 1 + 30 * 4) / 40] * 2)


def test_a_tensor_nobody_sent_keeps_its_global_value():
    g = {"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)}
    for name in ("fedavg", "median", "fedadam"):
        out = _run(name, g, [({"x": np.ones(2, np.float32)}, 1.0)])
        assert "y" not in out, name  # the engine and the simulator keep the global tensor


@st.composite
def _rounds(draw):
    n = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    names = list(SHAPES)
    sent = []
    for _ in range(n):
        layers = draw(st.lists(st.sampled_from(names[:-1]), max_size=3, unique=True))
        sent.append(sorted(layers) + ["head.w"])  # the head always travels, as under SAFL
    weights = [float(draw(st.integers(1, 100))) for _ in range(n)]
    g = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    updates = [({k: rng.standard_normal(SHAPES[k]).astype(np.float32) for k in names_i}, w)
               for names_i, w in zip(sent, weights)]
    return g, updates


def _reference(kind, g, updates):
    out = {}
    for name, ref in g.items():
        senders = [(u[name].astype(np.float64), w) for u, w in updates if name in u]
        if not senders:
            continue
        stack = np.stack([d for d, _ in senders])
        w = np.array([w for _, w in senders])
        if kind == "fedavg":
            step = np.tensordot(w / w.sum(), stack, axes=1)
        elif kind == "median":
            step = np.median(stack, axis=0)
        else:  # trimmed-mean, beta 0.2
            k = int(np.floor(0.2 * len(senders)))
            step = np.sort(stack, axis=0)[k:len(senders) - k].mean(axis=0)
        out[name] = ref.astype(np.float64) + step
    return out


@pytest.mark.parametrize("kind", ["fedavg", "median", "trimmed-mean"])
@settings(max_examples=40, deadline=None)
@given(case=_rounds())
def test_partial_updates_match_a_direct_per_tensor_reference(kind, case):
    g, updates = case
    got = _run(kind, g, updates)
    want = _reference(kind, g, updates)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_every_strategy_says_whether_it_takes_partial_updates():
    ok = {name for name in STRATEGIES if not make_strategy(name).partial_updates_problem()}
    assert ok == {"fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi", "median", "trimmed-mean", "norm-bounded",
                  "fedatt"}
    assert make_strategy("fedatt", {"granularity": "whole_model"}).partial_updates_problem()
