"""FedNER's private modules over the real services: two agents train the FedNER tagger for two rounds with the
paper's split (embeddings and CNNs shared; BiLSTM, emission layer and CRF private). The aggregator receives and
changes only the shared tensors; each site keeps, evaluates with and exports its own private tensors; the global
models equal a replay of the same rounds with the shared code."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.models.fedner import PAPER_PRIVATE_PATTERNS
from fedclinic.transport.package import ModelPackage
from fedclinic.spec.task import Task

from tests.helpers.federation import stored_update_tensors
from tests.helpers.fedner_models import ARCH, PRIVATE, SHARED, package
from tests.helpers.ner_models import LABELS, NER_POLICY, make_examples, write_jsonl

pytestmark = pytest.mark.integration

SITES = {"site-a": 16, "site-b": 24}


def _data(site: str):
    i = sorted(SITES).index(site)
    return make_examples(SITES[site], seed=30 + i), make_examples(10, seed=80 + i)


def _replay(start: ModelPackage, spec, rounds: int):
    """Every round recomputed here: each site evaluates and trains (global shared tensors + its own private
    ones), keeps its private tensors, and sends its shared delta; sample-weighted FedAvg of the shared deltas.
    Returns the global tensors after each round, each site's private tensors after the last round and each
    site's evaluation per round (and of its own final model, round "final")."""
    from dataclasses import replace

    from fedclinic.training import trainer as training
    from fedclinic.models import build_model, load_tensors, module_tensors
    from fedclinic.federation.site_round import site_seed

    cfg = training.TrainConfig.from_proto(spec.training)
    private = {site: {n: start.tensors[n] for n in PRIVATE} for site in SITES}
    global_tensors = dict(start.tensors)
    models, evals = {}, {}
    for rnd in range(1, rounds + 1):
        sums, total = {n: 0.0 for n in SHARED}, 0
        for site in SITES:
            train, held_out = _data(site)
            loaded = build_model(start)
            load_tensors(loaded.module, {**global_tensors, **private[site]})
            evals[(site, rnd)] = training.evaluate(loaded, training.encode(held_out, loaded, max_length=cfg.max_length))
            data = training.encode(train, loaded, max_length=cfg.max_length)
            before = module_tensors(loaded.module, SHARED)
            # each site's own seed per round (fedclinic.federation.site_round.site_seed; issue 15: agents used the task's seed)
            site_cfg = replace(cfg, seed=site_seed(cfg.seed, rnd, site))
            result = training.train_local(loaded, data, site_cfg, trainable=SHARED + PRIVATE)
            delta = training.compute_delta(before, module_tensors(loaded.module, SHARED), SHARED)
            private[site] = module_tensors(loaded.module, PRIVATE)
            for n in SHARED:
                sums[n] = sums[n] + result.num_samples * delta[n].astype(np.float64)
            total += result.num_samples
        global_tensors = {**global_tensors, **{n: global_tensors[n] + sums[n] / total for n in SHARED}}
        models[rnd] = global_tensors
    for site in SITES:  # each site's own final model: the last global shared tensors + its private ones
        loaded = build_model(start)
        load_tensors(loaded.module, {**global_tensors, **private[site]})
        evals[(site, "final")] = training.evaluate(loaded, training.encode(_data(site)[1], loaded,
                                                                           max_length=cfg.max_length))
    return models, private, evals


def test_private_modules_stay_at_each_site_for_two_rounds_and_the_site_exports_its_own_model(tmp_path):
    setups = []
    for site in SITES:
        folder = tmp_path / "data" / site
        folder.mkdir(parents=True)
        train, held_out = _data(site)
        write_jsonl(folder / "train.jsonl", train)
        write_jsonl(folder / "eval.jsonl", held_out)
        setups.append(SiteSetup(site, datasets={"ner": {"path": str(folder / "train.jsonl"),
                                                        "eval_path": str(folder / "eval.jsonl")}}, policy=NER_POLICY))
    task = Task(name="fedner-private-it", family="token-classification", architecture=ARCH, dataset="ner",
                labels=LABELS, num_rounds=2, min_sites=2, local_epochs=2, batch_size=8, learning_rate=1e-2,
                optimizer="adamw", max_length=32, round_timeout_s=180, on_quorum_miss="fail",
                private=list(PAPER_PRIVATE_PATTERNS))
    start = package(seed=1)
    with LocalFederation(tmp_path / "fed", setups, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            st = client.submit(task, package=start)
            final = client.wait(st.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            models = {r: client.fetch_package(st.task_id, round=r) for r in (-1, 1, 2)}
        stored = stored_update_tensors(fed, st.task_id)
        kept = {site: fed.root / f"agent-{site}" / "private-modules" / f"{st.task_id}.safetensors" for site in SITES}
        exported = tmp_path / "site-a-model"
        cli = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "model", "export", st.task_id, str(exported),
                              "--config", str(fed.agent_config_path("site-a"))], capture_output=True, text=True,
                             timeout=120)
        again = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "model", "export", st.task_id,
                                str(exported), "--config", str(fed.agent_config_path("site-a"))],
                               capture_output=True, text=True, timeout=120)

    assert list(final.spec.update.private_patterns) == list(PAPER_PRIVATE_PATTERNS)
    # the final evaluation: each site scores the final shared model and its own (with its private tensors)
    assert {(c.site_id, c.model) for c in final.results.cells} == {(s, m) for s in SITES for m in ("final", "own")}
    # what reached the aggregator: the shared tensors only, from both sites, in both rounds
    assert stored == {(site, rnd): set(SHARED) for site in SITES for rnd in (1, 2)}
    expected, private, evals = _replay(models[-1], final.spec, rounds=2)
    for rnd in (1, 2):
        for name in PRIVATE:  # never aggregated: the global model keeps the initial values
            np.testing.assert_array_equal(models[rnd].tensors[name], start.tensors[name], err_msg=name)
        for name in SHARED:
            np.testing.assert_allclose(models[rnd].tensors[name], expected[rnd][name], rtol=1e-4, atol=1e-6,
                                       err_msg=f"round {rnd} tensor {name}")
        # each site evaluated with its own private tensors (round 2: those it trained in round 1)
        reports = {r.site_id: r for r in final.rounds[rnd - 1].reports}
        for site in SITES:
            assert reports[site].eval_metrics["eval_strict_f1"] == pytest.approx(evals[(site, rnd)]["strict_f1"],
                                                                                  abs=1e-9), (site, rnd)
    # each site keeps its trained private tensors on disk (0600), different per site, as the replay says
    from fedclinic.training.private_modules import PrivateStore

    held = {}
    for site, path in kept.items():
        assert path.stat().st_mode & 0o777 == 0o600
        held[site], rnd = PrivateStore(path.parent).load(st.task_id)
        assert rnd == 2 and sorted(held[site]) == sorted(PRIVATE)
        for name in PRIVATE:
            # AdamW's normalised steps amplify float-summation noise (other thread counts in the agent): 1e-5
            np.testing.assert_allclose(held[site][name], private[site][name], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{site} {name}")
    assert not np.allclose(held["site-a"]["crf.transitions"], held["site-b"]["crf.transitions"])
    assert not np.allclose(held["site-a"]["crf.transitions"], start.tensors["crf.transitions"])
    # the site's own model: the final global model with site-a's private tensors, loadable and usable
    assert cli.returncode == 0, cli.stderr
    assert "private modules" in cli.stdout and "round 2" in cli.stdout
    own = ModelPackage.load(exported)
    for name in SHARED:
        np.testing.assert_array_equal(own.tensors[name], models[2].tensors[name])
    for name in PRIVATE:
        np.testing.assert_array_equal(own.tensors[name], held["site-a"][name])
    provenance = json.loads((exported / "site_model.json").read_text())
    assert (provenance["site"], provenance["private_round"]) == ("site-a", 2)
    assert provenance["global_model_hash"] == final.final_model_hash
    assert again.returncode == 2 and "not an empty folder" in again.stderr  # nothing already written is replaced
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model

    loaded = build_model(own)
    f1 = training.evaluate(loaded, training.encode(_data("site-a")[1], loaded, max_length=32))["strict_f1"]
    assert f1 == pytest.approx(evals[("site-a", "final")]["strict_f1"], abs=1e-9)
    # the global model card tells a reader that the sites hold the private modules
    from fedclinic.spec.model_card import PRIVATE_NOTE, build_card

    card = build_card(models[2].meta, model_hash=final.final_model_hash, status=final)
    assert PRIVATE_NOTE in card["notes"] and card["update"]["private"] == list(PAPER_PRIVATE_PATTERNS)
