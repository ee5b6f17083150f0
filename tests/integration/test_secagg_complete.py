"""Secure aggregation without giving up the rest (issue 17), over the real services: the same task runs plain and with
``[secure_aggregation]`` in one federation (same seed, same starting model, so every site trains the same delta), and
the secure round's model and evaluation metrics equal the plain round's within the documented quantization bound --
with sample weighting and per-site evaluation summed under the masks, with 8-bit quantization in a narrow ring
(``uint16`` on the wire), and with SAFL's per-layer weights. Nothing per site is shown for the secure rounds."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.errors import ConfigError, FedclinicError
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.tasks import make_task
from tests.helpers.text_models import make_examples, tiny_package

pytestmark = pytest.mark.integration

CLIP = 0.5


def _write(path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sites(tmp_path, samples, *, eval_rows: int = 0) -> list[SiteSetup]:
    sites = []
    for i, n in enumerate(samples):
        name = f"site-{'abcdefg'[i]}"
        rows = make_examples(n + eval_rows, seed=i)
        data = {"path": _write(tmp_path / "data" / name / "train.jsonl", rows[eval_rows:]), "format": "jsonl"}
        if eval_rows:
            data["eval_path"] = _write(tmp_path / "data" / name / "eval.jsonl", rows[:eval_rows])
        sites.append(SiteSetup(name, datasets={"notes": data}))
    return sites


def _run(client, task, package):
    st = client.submit(task, package=package)
    final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    return final, client.fetch_package(st.task_id, round=1)


def _plain_and_secure(tmp_path, sites, package, make, secure_variants):
    """Run ``make(secure_aggregation={})`` and ``make(secure_aggregation=v)`` for each variant; return the rounds."""
    out = []
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            out.append(_run(client, make(secure_aggregation={}), package))
            for variant in secure_variants:
                out.append(_run(client, make(secure_aggregation={"enabled": True, "clip": CLIP, **variant}),
                                package))
    return out


def _assert_models_equal(plain, secure, bound):
    for name, want in plain.tensors.items():
        np.testing.assert_allclose(secure.tensors[name], want, rtol=0, atol=bound + 1e-6, err_msg=name)


def test_sample_weighted_secure_round_with_aggregate_evaluation_equals_the_plain_round(tmp_path):
    samples = (12, 40, 72)  # very different sizes: the uniform mean is far from the sample-weighted one
    sites = _sites(tmp_path, samples, eval_rows=10)

    def make(**kw):
        return make_task(num_rounds=1, local_epochs=1, learning_rate=0.05, seed=1, **kw)

    (plain_status, plain), (secure_status, secure), (_, uniform) = _plain_and_secure(
        tmp_path, sites, tiny_package("logreg"), make, [{"bits": 20}, {"bits": 20, "weighting": "uniform"}])
    p, s = plain_status.rounds[0], secure_status.rounds[0]
    assert s.metrics.get("secagg_ring_bits") == 64, dict(s.metrics)  # 3 sites x 2^20 levels x weights up to 65536
    assert s.metrics["secagg_total_weight"] == sum(samples)  # only the sum of the sample counts is revealed
    assert list(s.reports) == [] and len(p.reports) == 3  # nothing per site is stored or shown for the secure round
    bound = s.metrics["secagg_error_bound"]
    assert 0 < bound < 2e-6
    _assert_models_equal(plain, secure, bound)
    # ...while the uniform mean (the only one secure aggregation gave before) is far from the plain round
    assert max(float(np.abs(uniform.tensors[n] - plain.tensors[n]).max()) for n in plain.tensors) > 10 * bound
    # per-site evaluation, summed under the same masks: the same sample-weighted figures the plain round shows
    # the figures, not the plain pool's bookkeeping (eval_rows, eval_sites: a secure round reveals no per-site counts)
    evals = {k: v for k, v in p.metrics.items() if k.startswith("eval_") and k not in ("eval_rows", "eval_sites")}
    assert {"eval_accuracy", "eval_loss"} <= set(evals)
    metric_bound = s.metrics["secagg_metric_error_bound"]
    assert 0 < metric_bound < 1e-4
    for k, v in evals.items():
        assert abs(s.metrics[k] - v) <= metric_bound + 1e-9, (k, s.metrics[k], v)


def test_int8_secure_rounds_travel_in_a_narrow_ring_and_equal_the_plain_round(tmp_path):
    sites = _sites(tmp_path, (24, 24, 24))  # equal sizes: uniform and sample weights give the same mean

    def make(**kw):
        return make_task(num_rounds=1, local_epochs=1, learning_rate=0.05, seed=2, **kw)

    (plain_status, plain), (uni_status, uni), (w_status, weighted) = _plain_and_secure(
        tmp_path, sites, tiny_package("logreg"), make,
        [{"bits": 8, "weighting": "uniform"}, {"bits": 8}])
    u, w = uni_status.rounds[0], w_status.rounds[0]
    assert u.metrics["secagg_ring_bits"] == 16  # 3 x 255 levels: the masked vector travels as uint16
    assert w.metrics["secagg_ring_bits"] == 32  # 3 x 255 levels x weights up to 65536
    step = 2 * CLIP / 255
    assert step < u.metrics["secagg_error_bound"] < 1.1 * step
    _assert_models_equal(plain, uni, u.metrics["secagg_error_bound"])
    _assert_models_equal(plain, weighted, w.metrics["secagg_error_bound"])
    # half the bytes per value on the wire: the 16-bit round's uplink is below the 32-bit round's
    assert u.uplink_bytes < w.uplink_bytes


def test_safl_under_secure_aggregation_averages_each_layer_over_the_sites_that_chose_it(tmp_path):
    from tests.helpers.safl_models import FLIP_CLS, FLIP_SEP, LABELS, constructed_package, length_examples

    layout = {"site-a": (12, 2), "site-b": (20, 10), "site-c": (16, 10)}  # as tests/integration/test_safl_federation
    sites = []
    for i, (site, (n, words)) in enumerate(sorted(layout.items())):
        rows = [{"text": ex.text, "label": ex.labels[0]} for ex in length_examples(n, words, seed=i)]
        sites.append(SiteSetup(site, datasets={"notes": {"path": _write(tmp_path / "data" / site / "train.jsonl", rows),
                                                         "format": "jsonl"}}))

    def make(**kw):
        return Task(name="safl-secure", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=1,
                    min_sites=3, local_epochs=1, batch_size=8, learning_rate=0.01, optimizer="sgd", max_length=16,
                    round_timeout_s=120, on_quorum_miss="fail", selection="safl", safl_top_k=1,
                    safl_profile_samples=6, **kw)

    (plain_status, plain), (secure_status, secure) = _plain_and_secure(
        tmp_path, sites, constructed_package(FLIP_CLS, FLIP_SEP), make, [{"bits": 20}])
    p, s = plain_status.rounds[0], secure_status.rounds[0]
    # in plain, site-a sent layer 1 and the others layer 0: each layer's mean has its own weight
    assert {r.site_id: list(r.selected_layers) for r in p.reports} == {"site-a": [1], "site-b": [0], "site-c": [0]}
    assert list(s.reports) == []
    _assert_models_equal(plain, secure, s.metrics["secagg_error_bound"])


def _committed_residuals(path, names, deadline_s: float = 60.0):
    """The site's committed error-feedback residuals once nothing is staged (the uploader commits on the masked
    input's receipt, which may trail the round's end by a moment)."""
    from fedclinic.codecs import ErrorFeedback

    deadline = time.monotonic() + deadline_s
    while True:
        ef = ErrorFeedback.load(path) if path.exists() else None
        if ef is not None and not ef.pending and set(names) <= set(ef.names):
            return {n: ef.residual(n) for n in names}
        assert time.monotonic() < deadline, f"no committed residual in {path}"
        threading.Event().wait(0.05)


def test_secure_top_k_sums_a_shared_random_index_set_and_keeps_the_rest_as_residual(tmp_path):
    """``topk:0.05`` under secure aggregation: every site sends the same shared random 5 % of the coordinates
    (masked); the model is the plain sample-weighted mean restricted to those coordinates (not rescaled) within the
    bound, the uplink shrinks to about 5 % of the dense secure round's, the published sum still recomputes, and each
    site keeps exactly the coordinates it did not send as its error-feedback residual."""
    from fedclinic.secagg.task_config import layout_for
    from fedclinic.verification.recompute import secure_round
    from tests.helpers.text_models import wide_package

    samples = (16, 40, 64)
    sites = _sites(tmp_path, samples)
    package = wide_package(padding_words=4000, embedding_dim=16)

    def make(**kw):
        return make_task(num_rounds=1, local_epochs=1, learning_rate=0.05, seed=3, architecture="lstm", **kw)

    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            (plain_status, plain) = _run(client, make(secure_aggregation={}), package)
            secure = {"enabled": True, "clip": CLIP, "bits": 20}
            (dense_status, _) = _run(client, make(secure_aggregation=secure), package)
            topk_task = make(secure_aggregation=secure, codec="topk:0.05")
            (topk_status, topk) = _run(client, topk_task, package)
            rec = client.task_records(topk_status.task_id).rounds[0]
            ring_sum = client.fetch_task_blob(topk_status.task_id, rec.secure_sum_sha256)
        params = json.loads(rec.secure_params_json)
        residuals = {site.name: _committed_residuals(
            fed.root / f"agent-{site.name}" / "codec-state" / f"{topk_status.task_id}.error-feedback.safetensors",
            params["names"]) for site in sites}
    d, t = dense_status.rounds[0], topk_status.rounds[0]
    assert list(t.reports) == []
    names = tuple(params["names"])
    shapes = tuple(tuple(s) for s in params["shapes"])
    layout = layout_for(topk_task.to_spec(), names, shapes, params["cohort"], tuple(params["metric_names"]),
                        index_seed=bytes.fromhex(params["index_seed"]))
    assert layout.sparse and layout.sent_values == int(np.ceil(0.05 * layout.values))
    keep = np.zeros(layout.values, bool)
    keep[layout.index_set()] = True
    bound = t.metrics["secagg_error_bound"]
    assert 0 < bound < 2e-6
    offset = 0
    mean_residual = {n: sum(w * residuals[s.name][n].astype(np.float64).ravel() for s, w in zip(sites, samples))
                     / sum(samples) for n in names}
    for name, shape in zip(names, shapes):
        size = int(np.prod(shape))
        mask = keep[offset:offset + size].reshape(shape)
        base = package.tensors[name].astype(np.float64)
        plain_delta = plain.tensors[name].astype(np.float64) - base
        want = base + np.where(mask, plain_delta, 0.0)  # the plain weighted mean on the shared set; 0 elsewhere
        np.testing.assert_allclose(topk.tensors[name], want, rtol=0, atol=bound + 1e-6, err_msg=name)
        # the sites keep what they did not send: their weighted residuals are the plain mean off the set
        np.testing.assert_allclose(mean_residual[name], np.where(mask, 0.0, plain_delta).ravel(), rtol=0, atol=1e-6,
                                   err_msg=name)
        offset += size
    assert any(np.abs(r).max() > 0 for r in mean_residual.values())
    # the masked vectors shrink to about F of the dense round's (plus the fixed key-agreement messages)
    ratio = t.uplink_bytes / d.uplink_bytes
    assert 0.05 <= ratio < 0.15, (t.uplink_bytes, d.uplink_bytes)
    print(f"uplink: dense secure {d.uplink_bytes} B, secure topk:0.05 {t.uplink_bytes} B (ratio {ratio:.3f}); "
          f"P = {layout.values}, m = {layout.sent_values}, ring {layout.quantizer.ring_bits} bits, bound {bound:.3g}")
    # `fedclinic task verify` recomputes the round from the published sum and seed
    recomputed = secure_round(topk_task.to_spec(), package.tensors, rec, ring_sum)
    for name in names:
        np.testing.assert_allclose(recomputed[name], topk.tensors[name], rtol=0, atol=1e-6, err_msg=name)


class _Unchecked(Task):
    """A task as another SDK version might send it: no local validation, so the aggregator must refuse it."""

    def validate(self) -> None:
        pass


@pytest.mark.parametrize("kw,reason", [
    (dict(codec="topk:0.1+int8"), "the masked vector is already quantized by secure aggregation's own quantizer"),
    (dict(codec="int8"), "the masked vector is already quantized by secure aggregation's own quantizer"),
    (dict(strategy="median"), "secure aggregation reveals only the sum"),
    (dict(privacy={"level": "client"}), 'privacy level "client" clips each site\'s update at the aggregator'),
    (dict(strategy="fedatt"), "secure aggregation reveals only the sum"),
])
def test_incompatible_combinations_are_refused_at_submit_with_the_reason(tmp_path, kw, reason):
    secure = {"secure_aggregation": {"enabled": True}, **kw}
    with pytest.raises(ConfigError, match=reason[:30]):
        make_task(**secure).validate()  # the SDK refuses first...
    with LocalFederation(tmp_path / "fed", [], agent_threads=1) as fed:
        fed.make_pki()
        fed.start_aggregator()
        with fed.client() as client, pytest.raises(FedclinicError) as refused:
            client.submit(_Unchecked(**vars(make_task(**secure))), package=tiny_package())
    assert reason in str(refused.value)  # ...and so does the aggregator, whatever the client checked
