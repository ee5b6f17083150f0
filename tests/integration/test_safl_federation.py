"""SAFL over the real services: each agent profiles attention, trains and sends its top-k layers and the head; the
aggregator averages each tensor over the sites that sent it and records who sent which layer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.training import safl
from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.spec.task import Task

from tests.helpers.federation import stored_update_tensors
from tests.helpers.safl_models import FLIP_CLS, FLIP_SEP, LABELS, constructed_package, length_examples

pytestmark = pytest.mark.integration

#: site -> (rows, words per row): short texts choose layer 1 of the constructed model, long ones layer 0
SITES = {"site-a": (12, 2), "site-b": (20, 10), "site-c": (16, 10)}


def _rows(site: str):
    n, words = SITES[site]
    return length_examples(n, words, seed=sorted(SITES).index(site))


def _replay(start, spec, rnd):
    """Round ``rnd`` recomputed here: each site's SAFL choice (same profiling seed as the agent), training and
    delta on the chosen tensors, then sample-weighted FedAvg per tensor over the sites that sent it."""
    from dataclasses import replace

    from fedclinic.training import trainer as training
    from fedclinic.models import build_model, module_tensors
    from fedclinic.federation.site_round import site_seed

    cfg = training.TrainConfig.from_proto(spec.training)
    config = safl.SaflConfig.from_spec(spec)
    sums, weights, sent = {}, {}, {}
    for site in SITES:
        loaded = build_model(start)
        data = training.encode(_rows(site), loaded, max_length=cfg.max_length)
        choice = safl.select_layers(loaded, data, config, safl.sendable(list(start.tensors), loaded.family),
                                    seed=safl.profile_seed(cfg.seed, rnd, site))
        sent[site] = (choice.layers, set(choice.tensors))
        before = module_tensors(loaded.module, choice.tensors)
        # each site's own seed per round (fedclinic.federation.site_round.site_seed; issue 15: agents used the task's seed)
        result = training.train_local(loaded, data, replace(cfg, seed=site_seed(cfg.seed, rnd, site)),
                                      trainable=choice.tensors)
        for name, d in training.compute_delta(before, module_tensors(loaded.module, choice.tensors),
                                              choice.tensors).items():
            sums[name] = sums.get(name, 0.0) + result.num_samples * d.astype(np.float64)
            weights[name] = weights.get(name, 0.0) + result.num_samples
    model = {n: start.tensors[n] + sums[n] / weights[n] if n in sums else start.tensors[n] for n in start.tensors}
    return model, sent


def test_safl_two_rounds_send_selected_layers_only_and_equal_a_replay(tmp_path):
    setups = []
    for site in SITES:
        folder = tmp_path / "data" / site
        folder.mkdir(parents=True)
        path = folder / "train.jsonl"
        path.write_text("".join(json.dumps({"text": ex.text, "label": ex.labels[0]}) + "\n" for ex in _rows(site)))
        setups.append(SiteSetup(site, datasets={"notes": {"path": str(path), "format": "jsonl"}}))
    task = Task(name="safl-it", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=2, min_sites=3,
                local_epochs=1, batch_size=8, learning_rate=0.01, optimizer="sgd", max_length=16, round_timeout_s=120,
                on_quorum_miss="fail", selection="safl", safl_top_k=1, safl_profile_samples=6)
    with LocalFederation(tmp_path / "fed", setups, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(task, package=constructed_package(FLIP_CLS, FLIP_SEP))
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            models = {r: client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)}
        stored = stored_update_tensors(fed, st.task_id)

    spec = final.spec
    assert (spec.update.selection, spec.update.select_top_k_layers) == ("safl", 1)
    start = models[-1]
    for rnd in (1, 2):
        expected, sent = _replay(start, spec, rnd)
        summary = final.rounds[rnd - 1]
        for site, (layers, tensors) in sent.items():
            assert stored[(site, rnd)] == tensors, (site, rnd)  # what the aggregator received: layers + head only
            assert all(safl.layer_of(n) in layers or n.startswith(("classifier.", "bert.pooler.")) for n in tensors)
        if rnd == 1:
            assert {site: layers for site, (layers, _) in sent.items()} == {
                "site-a": [1], "site-b": [0], "site-c": [0]}  # different layers: per-tensor averaging is exercised
        reports = {r.site_id: r for r in summary.reports}
        assert {site: list(r.selected_layers) for site, r in reports.items()} == {
            site: layers for site, (layers, _) in sent.items()}
        assert all({f"safl_score_{layer}" for layer in range(3)} <= set(r.metrics) for r in reports.values())
        counts = {k: v for k, v in summary.metrics.items() if k.startswith("safl_layer_")}
        want: dict[str, float] = {}
        for layers, _ in sent.values():
            for layer in layers:
                want[f"safl_layer_{layer}_sites"] = want.get(f"safl_layer_{layer}_sites", 0.0) + 1
        assert counts == want
        for name, arr in expected.items():
            np.testing.assert_allclose(models[rnd].tensors[name], arr, rtol=1e-5, atol=1e-6,
                                       err_msg=f"round {rnd} tensor {name}")
        start = models[rnd]
    from fedclinic.client import _headline
    from fedclinic.spec.model_card import build_card

    card = build_card(models[2].meta, model_hash=final.final_model_hash, status=final)
    assert card["update"]["selection"] == {"method": "safl", "top_k": 1, "profile_samples": 6, "token": "cls"}
    assert card["rounds"][0]["selected_layers"] == {"site-a": [1], "site-b": [0], "site-c": [0]}
    assert " layers 0:2 1:1" in _headline(dict(final.rounds[0].metrics))  # watch's line for round 1
    full = sum(4 * a.size for a in models[-1].tensors.values())
    assert all(r.uplink_fp32_bytes < full / 2 for s in final.rounds for r in s.reports)  # only a fraction travels


def test_safl_on_a_mean_pooled_model_sends_the_chosen_layer_and_the_classifier_only(tmp_path):
    """With mean pooling the model has no pooler, so a site's update is its chosen layer plus ``classifier.*``:
    nothing travels every round that the head does not need (issue #6's SAFL byte count)."""
    from fedclinic.models import package_from_config, wordlevel_tokenizer_json
    from tests.helpers.safl_models import WORDS

    setups = []
    for site in SITES:
        path = tmp_path / "data" / site / "train.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"text": ex.text, "label": ex.labels[0]}) + "\n" for ex in _rows(site)))
        setups.append(SiteSetup(site, datasets={"notes": {"path": str(path), "format": "jsonl"}}))
    config = {"model_type": "bert", "hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
              "intermediate_size": 16, "max_position_embeddings": 32, "pooling": "mean"}
    package = package_from_config(architecture="transformer", labels=LABELS, config=config, max_length=16,
                                  tokenizer_json=wordlevel_tokenizer_json(WORDS))
    task = Task(name="safl-mean", dataset="notes", labels=LABELS, architecture="transformer", num_rounds=1,
                min_sites=3, local_epochs=1, batch_size=8, learning_rate=0.01, optimizer="sgd", max_length=16,
                round_timeout_s=120, on_quorum_miss="fail", selection="safl", safl_top_k=1, safl_profile_samples=6)
    with LocalFederation(tmp_path / "fed", setups, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(task, package=package)
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
        stored = stored_update_tensors(fed, st.task_id)
    reports = {r.site_id: r for r in final.rounds[0].reports}
    for site in SITES:
        (layer,) = reports[site].selected_layers
        layer_names = {n for n in package.tensors if safl.layer_of(n) == layer}
        assert stored[(site, 1)] == layer_names | {"classifier.weight", "classifier.bias"}, site
        sent = sum(4 * package.tensors[n].size for n in stored[(site, 1)])
        assert reports[site].uplink_fp32_bytes == sent
