"""Secure aggregation beyond the uniform mean (issue 17): sample weights, per-tensor counts (SAFL), evaluation
metrics summed under the masks, and narrow/wide rings -- each through a full in-process session, equal to the plain
computation within the layout's documented bound."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedclinic.secagg import SecAggConfigError, SecAggInputError, SessionParams, run_round
from fedclinic.secagg.masks import apply_masks, expand_mask
from fedclinic.secagg.quantize import Quantizer, ring_for
from fedclinic.secagg.vector_layout import VectorLayout

MODEL = hashlib.sha256(b"model").digest()
COHORT = tuple(f"site-{i:02d}" for i in range(5))
TENSORS = (("layer.0.w", 300), ("layer.1.w", 200), ("head.b", 7))


def _session(layout: VectorLayout) -> SessionParams:
    return SessionParams("t", 1, COHORT, MODEL, layout.length, quantizer=layout.quantizer)


def _deltas(rng, clip):
    return {c: {n: (rng.standard_normal(size) * clip / 3).clip(-clip, clip).astype(np.float32)
                for n, size in TENSORS} for c in COHORT}


@pytest.mark.parametrize("bits,ring", [(20, 64), (8, 64), (12, 64)])
def test_sample_weighted_secure_sum_equals_weighted_fedavg_and_metrics(bits, ring):
    rng = np.random.default_rng(bits)
    q = Quantizer(clip=0.5, bits=bits, ring_bits=ring, weight_cap=4096)
    layout = VectorLayout(TENSORS, q, metric_names=("accuracy", "loss"), metric_clip=100.0)
    deltas = _deltas(rng, 0.5)
    samples = {c: int(n) for c, n in zip(COHORT, (16, 900, 33, 4096, 70))}
    metrics = {c: {"accuracy": float(rng.uniform()), "loss": float(rng.uniform(0, 5))} for c in COHORT}
    metrics["site-02"].pop("loss")                        # a site without the metric: count 0 for it
    metrics["site-03"]["loss"] = float("nan")             # ...or with a non-finite value
    updates = {c: layout.encode(deltas[c], weight=layout.weight_of(samples[c]), metrics=metrics[c]) for c in COHORT}
    assert all(u.dtype == q.dtype for u in updates.values())
    result = run_round(_session(layout), updates)
    got = layout.decode(result.quantized_sum)
    total_w = sum(samples.values())
    for name, _ in TENSORS:
        plain = sum(samples[c] * deltas[c][name].astype(np.float64) for c in COHORT) / total_w
        assert np.abs(got.tensors[name] - plain).max() <= layout.error_bound(), name
        assert got.tensor_weights[name] == total_w
    # the round's sample-weighted evaluation metrics, as aggregator_service.round_metrics.weighted_mean computes them
    acc = sum(samples[c] * metrics[c]["accuracy"] for c in COHORT) / total_w
    with_loss = [c for c in COHORT if c not in ("site-02", "site-03")]
    loss = sum(samples[c] * metrics[c]["loss"] for c in with_loss) / sum(samples[c] for c in with_loss)
    assert abs(got.metrics["accuracy"] - acc) <= layout.metric_error_bound()
    assert abs(got.metrics["loss"] - loss) <= layout.metric_error_bound()
    assert got.metric_weights["loss"] == sum(samples[c] for c in with_loss)


def test_safl_per_tensor_counts_give_per_layer_means_and_skip_unsent_layers():
    rng = np.random.default_rng(3)
    q = Quantizer(clip=0.5, bits=16, ring_bits=64, weight_cap=1000)
    layout = VectorLayout(TENSORS, q, per_tensor_counts=True)
    deltas = _deltas(rng, 0.5)
    sent = {"site-00": {"layer.0.w", "head.b"}, "site-01": {"layer.0.w", "head.b"}, "site-02": {"head.b"},
            "site-03": {"head.b"}, "site-04": {"layer.0.w", "head.b"}}  # nobody selected layer.1
    weights = {c: 10 * (i + 1) for i, c in enumerate(COHORT)}
    updates = {c: layout.encode({n: deltas[c][n] for n in sent[c]}, weight=weights[c]) for c in COHORT}
    got = layout.decode(run_round(_session(layout), updates).quantized_sum)
    assert "layer.1.w" not in got.tensors  # no site sent it: the global model keeps it
    for name in ("layer.0.w", "head.b"):
        senders = [c for c in COHORT if name in sent[c]]
        w = sum(weights[c] for c in senders)
        plain = sum(weights[c] * deltas[c][name].astype(np.float64) for c in senders) / w
        assert got.tensor_weights[name] == w
        assert np.abs(got.tensors[name] - plain).max() <= layout.error_bound(), name


def test_int8_uniform_inputs_travel_in_a_uint16_ring():
    rng = np.random.default_rng(8)
    assert ring_for(255, 1, 257) == 16 and ring_for(255, 1, 258) == 32
    q = Quantizer(clip=0.5, bits=8, ring_bits=ring_for(255, 1, len(COHORT)))
    layout = VectorLayout(TENSORS, q)
    deltas = _deltas(rng, 0.5)
    updates = {c: layout.encode(deltas[c], weight=1) for c in COHORT}
    assert q.dtype == np.uint16 and updates["site-00"].nbytes == 2 * layout.length
    got = layout.decode(run_round(_session(layout), updates).quantized_sum)
    for name, _ in TENSORS:
        plain = np.mean([deltas[c][name].astype(np.float64) for c in COHORT], axis=0)
        assert np.abs(got.tensors[name] - plain).max() <= layout.error_bound()


def test_a_ring_that_could_wrap_is_refused_with_the_reason():
    with pytest.raises(SecAggConfigError, match="wrap the 16-bit masked sum"):
        SessionParams("t", 1, tuple(f"s{i}" for i in range(300)), MODEL, 10,
                      quantizer=Quantizer(bits=8, ring_bits=16))
    with pytest.raises(SecAggConfigError, match="do not fit one 16-bit ring element"):
        Quantizer(bits=12, ring_bits=16, weight_cap=100)
    with pytest.raises(SecAggConfigError, match="exceed 2\\^53"):
        ring_for((1 << 24) - 1, 1 << 24, 1 << 10)


def test_encode_refuses_what_the_layout_does_not_hold():
    layout = VectorLayout(TENSORS, Quantizer(weight_cap=10, ring_bits=64), metric_names=("accuracy",))
    full = {n: np.zeros(s, np.float32) for n, s in TENSORS}
    with pytest.raises(SecAggInputError, match="weight must be an integer in \\[1, 10\\]"):
        layout.encode(full, weight=11)
    with pytest.raises(SecAggInputError, match="every site of this session sends every tensor"):
        layout.encode({"head.b": np.zeros(7, np.float32)}, weight=1)
    with pytest.raises(SecAggInputError, match="metrics outside"):
        layout.encode(full, weight=1, metrics={"f1": 0.5})
    assert layout.weight_of(0) == 1 and layout.weight_of(10_000) == 10


@pytest.mark.parametrize("dtype", [np.uint16, np.uint64])
def test_masks_in_other_rings_are_the_keystream_words_and_split_freely(dtype):
    key = bytes(range(32))
    n = 3 * (1 << 18) + 5  # several pieces with 2 workers
    ref = expand_mask(key, n, dtype)
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    size = np.dtype(dtype).itemsize
    words = np.frombuffer(enc.update(bytes(size * n)), dtype=np.dtype(dtype).newbyteorder("<"))
    assert np.array_equal(ref, words)
    x = np.arange(n, dtype=dtype)
    apply_masks(x, add=[key], workers=2, chunk_words=1000)
    apply_masks(x, subtract=[key], workers=1)
    assert np.array_equal(x, np.arange(n, dtype=dtype))


def test_the_layout_is_part_of_the_session_id():
    """Two layouts of the same length (metric names swapped for others, or the metric precision changed) give
    different session ids, so a site given another layout than its peers refuses the setup or its masks do not
    cancel: the aggregator cannot read one site's slots against the others'."""
    q = Quantizer(bits=16, ring_bits=64, weight_cap=1000)
    base = VectorLayout((("w", 6), ("b", 2)), q, metric_names=("accuracy", "loss"))
    renamed = VectorLayout((("w", 6), ("b", 2)), q, metric_names=("accuracy", "f1"))
    coarser = VectorLayout((("w", 6), ("b", 2)), q, metric_names=("accuracy", "loss"), metric_bits=12)
    assert base.length == renamed.length == coarser.length
    ids = {SessionParams("t", 1, COHORT, MODEL, x.length, quantizer=q, nonce=b"n" * 16,
                         layout_digest=x.digest()).session_id for x in (base, renamed, coarser)}
    assert len(ids) == 3
    same = SessionParams("t", 1, COHORT, MODEL, base.length, quantizer=q, nonce=b"n" * 16,
                         layout_digest=VectorLayout((("w", 6), ("b", 2)), q,
                                                    metric_names=("accuracy", "loss")).digest())
    assert same.session_id in ids
