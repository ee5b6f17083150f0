"""One site round (fedclinic.federation.site_round): the simulator and a hospital agent compute the same update, bit for bit.

The same task runs through the simulator (fedclinic.federation.simulate, which hands each site's round to ``site_rounds``)
and through the agent's own round code (hospital_agent.training_step.TrainingStep, with its error-feedback file
and privacy plan, the aggregator's send list, and the global model of each round), for sites named as agents
are. Their encoded updates (headers and payloads) must be identical for every codec and every selection mode, and
for DP-SGD (given the same sampler/noise entropy on both sides) the trained deltas.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from aggregator_service.update_admission import sent_tensors
from fedclinic.training import trainer as training
from fedclinic.codecs import available_codecs
from fedclinic.models import build_model, load_tensors, package_from_config
from fedclinic.transport.package import ModelPackage
from fedclinic.training.private_modules import private_names
from fedclinic.proto import agent_pb2
from fedclinic.training.safl import SaflConfig
from fedclinic.federation.simulate import SampleDP, simulate
from fedclinic.federation.site_round import site_seed
from fedclinic.spec.task import Task
from hospital_agent.config import AgentConfig
from hospital_agent.task_state import TaskState
from hospital_agent.worker import Agent
from tests.helpers.symptom_models import LABELS, TOK, random_examples

TINY_BERT = dict(model_type="bert", hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                 max_position_embeddings=32, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
SITES = ["st-mary", "north-general"]  # names, as agents know theirs from their certificates
TASK_ID = "t-equivalence"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


SITE_ROWS = [random_examples(12, 1), random_examples(12, 2)]  # equal sizes: under the old seeding both sites shuffled alike


def package(arch: str) -> ModelPackage:
    config = {"transformer": TINY_BERT, "logreg": {}}[arch]
    return package_from_config(architecture=arch, labels=LABELS, tokenizer_json=TOK, config=config, max_length=16,
                               seed=3)


def task(arch: str, **kw) -> Task:
    return Task(name="eq", dataset="notes", family="text-classification", architecture=arch, labels=LABELS,
                local_epochs=1, batch_size=4, learning_rate=0.05, max_length=16, seed=11, num_rounds=2, **kw)


def run_simulator(t: Task, start: ModelPackage, rounds: int, dp: SampleDP | None = None):
    spec = t.to_spec()
    seen = {}
    res = simulate(start, SITE_ROWS, rounds=rounds, train=training.TrainConfig.from_proto(spec.training, device="cpu"),
                   trainable_patterns=t.trainable, private_patterns=t.private, codec=t.codec,
                   safl=SaflConfig.from_spec(spec), dp=dp, site_names=SITES, task_id=TASK_ID,
                   site_rounds=lambda r, i, out: seen.__setitem__((r, SITES[i]), out))
    return res, seen


def run_agents(t: Task, start: ModelPackage, globals_: list[dict[str, np.ndarray]], root, dp_entropy=None,
               patient_ids=None):
    """Each site's rounds through the agent's code: its TrainingStep on a warm model synced to each round's global
    model, the aggregator's send list, its privacy plan and error-feedback file (committed as an acknowledgement
    does)."""
    spec = t.to_spec()
    send = sent_tensors(spec, start.manifest())
    data_file = root / "notes.jsonl"
    data_file.write_text("".join(json.dumps({"text": r.text, "label": r.labels[0]}) + "\n" for r in SITE_ROWS[0]))
    out = {}
    for site, site_rows in zip(SITES, SITE_ROWS):
        cfg = AgentConfig.from_dict({"aggregator": "127.0.0.1:1", "work_dir": str(root / site),
                                     "tls": {"cert": "a", "key": "b", "ca": "c"},
                                     "datasets": {"notes": {"path": str(data_file), "privacy_epsilon": 1e6,
                                                            "privacy_delta": 1e-5}}},
                                    base=root, source="agent.toml")
        agent = Agent(cfg)
        agent.site_id = site
        agent.training.dp_entropy = dp_entropy
        state = TaskState(loaded=build_model(start))
        state.train_data = training.encode(site_rows, state.loaded, max_length=16)
        train_cfg = training.TrainConfig.from_proto(spec.training, device="cpu")
        private = private_names(list(start.tensors), t.private)
        if patient_ids is not None:  # what prepare_data reads from the dataset's group_field
            state.patient_ids = list(patient_ids[SITES.index(site)])
        if spec.privacy.level == "sample":
            patients = len(set(state.patient_ids)) if state.patient_ids is not None else None
            verdict, state.private = agent.budget.admit(agent_pb2.Assignment(task_id=TASK_ID, spec=spec),
                                                        len(site_rows), train_cfg.batch_size, train_cfg.local_epochs,
                                                        num_patients=patients)
            assert verdict.proceed
        for r, global_tensors in enumerate(globals_, start=1):
            a = agent_pb2.Assignment(task_id=TASK_ID, round=r, spec=spec, send_tensors=send)
            load_tensors(state.loaded.module, global_tensors)  # what model sync leaves in the warm model
            if private:
                agent.training.restore_private(TASK_ID, state, private)
            out[(r, site)] = agent.training.run(a, state, train_cfg, private)
            agent.training.stage_feedback(TASK_ID, out[(r, site)])
            agent.uploader.settle_feedback(TASK_ID, delivered=True)  # as the aggregator's receipt does
    return out


def assert_same_updates(sim: dict, agents: dict) -> None:
    assert sorted(sim) == sorted(agents)
    for key, s in sim.items():
        a = agents[key].site
        assert s.seed == a.seed == site_seed(11, key[0], key[1]), key
        assert s.send == a.send, key
        assert [h.SerializeToString(deterministic=True) for h in s.update.headers] == \
            [h.SerializeToString(deterministic=True) for h in a.update.headers], key
        for name in s.send:
            p, q = s.update.payloads[name], a.update.payloads[name]
            assert bytes(np.asarray(p).tobytes() if isinstance(p, np.ndarray) else p) == \
                bytes(np.asarray(q).tobytes() if isinstance(q, np.ndarray) else q), (key, name)
        assert any(np.abs(d).max() > 0 for d in s.delta.values()), key  # something was trained


def both(t: Task, arch: str, tmp_path, rounds: int = 1, dp: SampleDP | None = None, dp_entropy=None,
         patient_ids=None):
    start = package(arch)
    res, sim = run_simulator(t, start, rounds, dp)
    globals_ = [start.tensors]
    if rounds == 2:  # the agents' round-2 global model: what the simulator's first round produced
        globals_.append(run_simulator(t, start, 1, dp)[0].package.tensors)
    agents = run_agents(t, start, globals_, tmp_path, dp_entropy, patient_ids)
    assert_same_updates(sim, agents)
    return res, sim, agents


@pytest.mark.parametrize("codec", ["raw", *[c for c in available_codecs() if c != "topk"], "topk:0.2",
                                   "topk:0.25+int8"])
def test_every_codec_gives_the_same_encoded_update_in_the_simulator_and_at_an_agent(codec, tmp_path):
    rounds = 2 if codec.startswith("topk") else 1  # top-k: round 2 sends with the residual round 1 kept
    _, sim, _ = both(task("logreg", codec=codec), "logreg", tmp_path, rounds=rounds)
    seeds = {out.seed for out in sim.values()}
    assert len(seeds) == len(sim)  # each site its own seed, a new one every round


def test_trainable_patterns_give_the_same_update(tmp_path):
    t = task("transformer", trainable=[r"classifier\..*", r"bert\.pooler\..*", r"bert\.encoder\.layer\.1\..*"],
             codec="int8")
    res, sim, _ = both(t, "transformer", tmp_path)
    assert sim[(1, SITES[0])].send == res.trainable and len(res.trainable) < len(package("transformer").tensors)


def test_safl_selection_gives_the_same_layers_and_update(tmp_path):
    t = task("transformer", selection="safl", safl_top_k=1, safl_profile_samples=6)
    _, sim, agents = both(t, "transformer", tmp_path)
    for key, out in sim.items():
        assert out.selection is not None and out.selection.layers == agents[key].site.selection.layers


def test_private_modules_give_the_same_update_and_stay_at_their_site(tmp_path):
    t = task("transformer", private=[r"classifier\..*"], codec="fp16")
    _, sim, agents = both(t, "transformer", tmp_path, rounds=2)  # round 2 trains on from the kept private values
    for key, out in sim.items():
        assert not any(n.startswith("classifier.") for n in out.send)
        kept = agents[key].site.private_values
        assert sorted(kept) == sorted(out.private_values)
        assert all(np.array_equal(kept[n], out.private_values[n]) for n in kept)


def test_dp_sgd_gives_the_same_clipped_and_noised_update_given_the_same_entropy(tmp_path):
    """DP-SGD's sampler and noise come from the OS at a site; with the same entropy given to both sides, the
    Poisson samples, the clipped sums and the noise are the same, so the updates are identical."""
    t = task("transformer", privacy={"level": "sample", "noise_multiplier": 0.5, "max_grad_norm": 0.7},
             trainable=[r"classifier\..*", r"bert\.pooler\..*"])
    dp = SampleDP(max_grad_norm=0.7, noise_multiplier=0.5, entropy=2024)
    both(t, "transformer", tmp_path, dp=dp, dp_entropy=2024)


def test_per_patient_dp_sgd_gives_the_same_update_in_the_simulator_and_at_an_agent(tmp_path):
    """unit = "patient": both sides plan over the site's patients (8 and 6 patients of 12 rows, 4 expected per step:
    q = 0.5 and 2/3, 2 steps each), sample and clip whole patients; with the same entropy the updates are
    identical (the agent's plan, sampling and clipping are the simulator's). Per row it would be 3 steps."""
    ids = [[f"p{i % 8}" for i in range(12)], [f"q{i // 2}" for i in range(12)]]
    privacy = {"level": "sample", "noise_multiplier": 0.5, "max_grad_norm": 0.7}
    trainable = [r"classifier\..*", r"bert\.pooler\..*"]
    t = task("transformer", privacy={**privacy, "unit": "patient"}, trainable=trainable)
    dp = SampleDP(max_grad_norm=0.7, noise_multiplier=0.5, entropy=2024, patient_ids=ids)
    _, sim, agents = both(t, "transformer", tmp_path, dp=dp, dp_entropy=2024, patient_ids=ids)
    assert all(out.train.steps == 2 for out in sim.values())
    _, per_row = run_simulator(task("transformer", privacy=privacy, trainable=trainable), package("transformer"), 1,
                               SampleDP(max_grad_norm=0.7, noise_multiplier=0.5, entropy=2024))
    assert all(out.train.steps == 3 for out in per_row.values())
