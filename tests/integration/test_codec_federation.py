"""Update codecs over the real services: encoded deltas travel, error feedback persists at the sites, the
aggregator decodes into FedAvg, and the result equals a replay of the same codec in memory."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.transport.codec_wire import tensor_rng, uses_error_feedback
from fedclinic.codecs import ErrorFeedback, decode, parse_codec

from tests.helpers.replay import replay_site
from tests.helpers.tasks import make_task
from tests.helpers.text_models import make_examples, tiny_package

pytestmark = pytest.mark.integration

SAMPLES = (24, 32, 40)
CODECS = ("raw", "topk:0.05+int8", "int8", "fp16")


def _replay(models, task_id, spec, codec_spec):
    """Expected round-1 and round-2 global models: each site's replayed delta, encoded as the agent encodes it
    (same codec, same per-tensor seed, error feedback carried from round 1 to round 2), decoded, FedAvg."""
    codec = None if codec_spec == "raw" else parse_codec(codec_spec)
    sites = {f"site-{c}": make_examples(n, seed=i) for i, (c, n) in enumerate(zip("abc", SAMPLES))}
    feedback = {site: ErrorFeedback(codec) for site in sites} if uses_error_feedback(codec) else {}
    expected = {}
    for rnd, start in ((1, models[-1]), (2, models[1])):
        total, acc = 0, {name: np.zeros(base.shape, np.float64) for name, base in start.tensors.items()}
        for site, rows in sites.items():
            delta, n = replay_site(start, rows, spec, site=site, rnd=rnd)
            total += n
            for name in start.tensors:
                x = np.ascontiguousarray(delta[name], dtype=np.float32)
                rng = tensor_rng(task_id, rnd, site, name)
                if codec is None:
                    sent = x
                else:
                    enc = feedback[site].encode(name, x, rng=rng) if feedback else codec.encode(x, rng=rng)
                    sent = decode(enc.payload, enc.params)
                acc[name] += n * sent.astype(np.float64)
            if feedback:
                feedback[site].commit()
        expected[rnd] = {name: start.tensors[name] + acc[name] / total for name in start.tensors}
    return expected, feedback


def test_codecs_travel_encoded_and_equal_a_replay(federation_factory):
    fed = federation_factory(3, samples=SAMPLES)
    with fed.client() as client:
        submitted = {spec: client.submit(make_task(name=f"codec-{i}", codec=spec), package=tiny_package())
                     for i, spec in enumerate(CODECS)}
        results = {}
        for spec, st in submitted.items():
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", (spec, final.error)
            results[spec] = (final, {r: client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)})
    measured = {}
    for spec, (final, models) in results.items():
        assert final.spec.update.codec == (spec if spec == "raw" else parse_codec(spec).spec)
        expected, feedback = _replay(models, final.task_id, final.spec, spec)
        for rnd in (1, 2):
            for name, arr in expected[rnd].items():
                np.testing.assert_allclose(models[rnd].tensors[name], arr, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{spec} round {rnd} tensor {name}")
        for rnd in final.rounds:
            m = dict(rnd.metrics)
            payload, fp32 = m["uplink_payload_bytes"], m["uplink_fp32_bytes"]
            assert payload == rnd.uplink_bytes == sum(r.uplink_bytes for r in rnd.reports)
            assert fp32 == sum(r.uplink_fp32_bytes for r in rnd.reports) == 3 * 4 * 62  # 62 float32 per site
            assert m["uplink_wire_bytes"] == sum(r.uplink_wire_bytes for r in rnd.reports) > payload
            assert m["uplink_reduction"] == pytest.approx(fp32 / payload)
            measured.setdefault(spec, []).append((int(payload), int(fp32), int(m["uplink_wire_bytes"])))
        if feedback:  # every site's committed residual equals the replay's: error feedback persisted for real
            for site, fb in feedback.items():
                path = fed.root / f"agent-{site}" / "codec-state" / f"{final.task_id}.error-feedback.safetensors"
                saved = ErrorFeedback.load(path)
                assert saved.pending == () and saved.names == fb.names
                for name in fb.names:
                    np.testing.assert_allclose(saved.residual(name), fb.residual(name), rtol=1e-5, atol=1e-6)
    print("uplink bytes per round (payload, fp32, wire):", json.dumps(measured))
    raw_payload = measured["raw"][0][0]
    assert raw_payload == 3 * 4 * 62
    assert measured["fp16"][0][0] == raw_payload // 2
    assert measured["int8"][0][0] < raw_payload // 2
    assert measured["topk:0.05+int8"][0][0] < measured["int8"][0][0]


def test_a_per_site_strategy_gets_decoded_updates(federation_factory):
    """median looks at every update: the aggregator decodes each encoded update into a float32 spill file."""
    from fedclinic.strategies import make_strategy

    fed = federation_factory(3, samples=SAMPLES)
    spec = "topk:0.25+fp16"
    with fed.client() as client:
        st = client.submit(make_task(name="codec-median", codec=spec, num_rounds=1, strategy="median"),
                           package=tiny_package())
        final = client.wait(st.task_id, timeout=300, progress=False)
        assert state_name(final.state) == "completed", final.error
        start, got = client.fetch_package(st.task_id, round=-1), client.fetch_package(st.task_id, round=1)
    codec = parse_codec(spec)
    strategy = make_strategy("median")
    strategy.begin(start.tensors)
    for i, (c, n) in enumerate(zip("abc", SAMPLES)):
        delta, _ = replay_site(start, make_examples(n, seed=i), final.spec, site=f"site-{c}", rnd=1)
        fb = ErrorFeedback(codec)
        sent = {}
        for name in start.tensors:
            enc = fb.encode(name, np.ascontiguousarray(delta[name], np.float32),
                            rng=tensor_rng(final.task_id, 1, f"site-{c}", name))
            sent[name] = decode(enc.payload, enc.params)
        strategy.accept(sent, float(n), site=f"site-{c}")
    for name, arr in strategy.finalize().items():
        np.testing.assert_allclose(got.tensors[name], arr, rtol=1e-5, atol=1e-6, err_msg=name)
