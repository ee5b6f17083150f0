"""SAFL layer scoring and selection (fedclinic.training.safl), its validation in the SDK and at the aggregator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.training import safl
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.spec.task import Task

from tests.helpers.safl_models import (
    CLS_LOGITS,
    FLIP_CLS,
    FLIP_SEP,
    LABELS,
    SEP_LOGITS,
    WORDS,
    bert_package,
    constructed_model,
    constructed_package,
    examples,
    length_examples,
)


# --------------------------------------------------------------------------------------------------------------
# the constructed case: attention to [CLS] / [SEP] set per layer, everything else inert


def _expected(lengths: list[int], token: str) -> np.ndarray:
    out = np.zeros(len(CLS_LOGITS))
    for layer, (x, y) in enumerate(zip(CLS_LOGITS, SEP_LOGITS)):
        for n in lengths:
            z = math.exp(x) + math.exp(y) + n - 2
            out[layer] += (math.exp(x) if token == "cls" else math.exp(y)) / z
    return out / len(lengths)


@pytest.mark.parametrize("token", ["cls", "last"])
def test_scores_equal_the_closed_form_of_the_constructed_model(token):
    from fedclinic.training import trainer as training

    loaded = constructed_model()
    rows = examples(7, seed=1)
    data = training.encode(rows, loaded, max_length=16)
    lengths = [int(n) for n in data.attention_mask.sum(dim=1)]
    assert len(set(lengths)) > 1  # padding is part of the case: padded queries and keys must not count
    scores = safl.attention_scores(loaded, data, range(len(rows)), token, batch_size=3)
    np.testing.assert_allclose(scores, _expected(lengths, token), rtol=1e-4, atol=1e-6)
    assert 0.0 < scores.min() and scores.max() < 1.0


def test_constructed_ranking_picks_the_layers_that_attend_most_to_the_token():
    from fedclinic.training import trainer as training

    loaded = constructed_model()
    data = training.encode(examples(5), loaded, max_length=16)
    names = list(loaded.module.state_dict())
    cls = safl.select_layers(loaded, data, safl.SaflConfig(top_k=2, token="cls"), names, seed=0)
    assert cls.layers == [1, 3]                  # CLS_LOGITS 8 and 4
    assert max(cls.scores, key=cls.scores.get) == 1
    last = safl.select_layers(loaded, data, safl.SaflConfig(top_k=3, token="last"), names, seed=0)
    # SEP_LOGITS 5 and 2.5 first; of the two layers with SEP_LOGITS 0, layer 3's [CLS] takes less mass than layer 1's
    assert last.layers == [0, 2, 3]
    assert last.scores[3] > last.scores[1]
    assert set(cls.tensors) == {n for n in names if n.startswith(("bert.encoder.layer.1.", "bert.encoder.layer.3."))
                                or n.startswith(("classifier.", "bert.pooler."))}
    assert loaded.module.config._attn_implementation == "sdpa" and not loaded.module.training


def test_profiling_restores_the_attention_implementation_and_training_mode():
    from fedclinic.training import trainer as training
    from fedclinic.models import build_model

    loaded = build_model(bert_package(layers=2))
    before = loaded.module.config._attn_implementation
    loaded.module.train()
    data = training.encode(examples(4), loaded, max_length=16)
    safl.attention_scores(loaded, data, [0, 1, 2, 3], "cls")
    assert loaded.module.config._attn_implementation == before
    assert loaded.module.training


def test_static_patterns_compose_frozen_layers_are_never_selected():
    from fedclinic.training import trainer as training
    from fedclinic.spec.selection import select_names

    loaded = constructed_model()
    data = training.encode(examples(5), loaded, max_length=16)
    allowed = select_names(list(loaded.module.state_dict()), frozen=[r"bert\.encoder\.layer\.1\..*", r"bert\.pooler\..*"])
    choice = safl.select_layers(loaded, data, safl.SaflConfig(top_k=2, token="cls"), allowed, seed=0)
    expected = _expected([int(n) for n in data.attention_mask.sum(dim=1)], "cls")
    assert int(np.argmax(expected)) == 1 and 1 not in choice.scores  # layer 1 scores highest but is frozen
    assert choice.layers == sorted(sorted([0, 2, 3], key=lambda layer: -expected[layer])[:2]) == [2, 3]
    assert not any(n.startswith(("bert.encoder.layer.1.", "bert.pooler.", "bert.embeddings.")) for n in choice.tensors)
    assert {n for n in choice.tensors if n.startswith("classifier.")} == {"classifier.weight", "classifier.bias"}
    with pytest.raises(ConfigError, match="safl_top_k is 4 but only 3 layer"):
        safl.select_layers(loaded, data, safl.SaflConfig(top_k=4), allowed, seed=0)


def test_entities_token_needs_per_token_tags():
    import torch

    mask = torch.ones(2, 4, dtype=torch.long)
    tags = torch.tensor([[0, 1, 2, 0], [0, 0, 0, -100]])
    np.testing.assert_array_equal(safl._relevant_keys("entities", mask, tags).numpy(),
                                  [[0, 1, 1, 0], [0, 0, 0, 0]])
    with pytest.raises(ConfigError, match="per-token tags"):
        safl._relevant_keys("entities", mask, torch.tensor([0, 1]))


# --------------------------------------------------------------------------------------------------------------
# names, selection and sampling


@pytest.mark.parametrize("name,layer", [
    ("bert.encoder.layer.3.attention.self.query.weight", 3), ("roberta.encoder.layer.11.output.dense.bias", 11),
    ("distilbert.transformer.layer.2.ffn.lin1.weight", 2), ("model.layers.23.mlp.up_proj.weight", 23),
    ("transformer.h.5.attn.c_attn.weight", 5), ("bert.embeddings.word_embeddings.weight", None),
    ("classifier.weight", None), ("bert.pooler.dense.weight", None), ("model.norm.weight", None),
    ("crf.transitions", None)])
def test_layer_of(name, layer):
    assert safl.layer_of(name) == layer


def test_heads_and_sendable():
    names = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.x.weight", "bert.encoder.layer.1.x.weight",
             "bert.pooler.dense.weight", "classifier.weight", "crf.transitions"]
    assert safl.sendable(names, "text-classification") == names[1:5]
    assert safl.sendable(names, "token-classification") == names[1:3] + names[4:]
    assert safl.selected_tensors(names, "text-classification", [1]) == names[2:5]
    assert safl.is_head("model.norm.weight", "question-answering")


def test_top_layers_ties_go_to_the_lower_index():
    assert safl.top_layers({0: 0.2, 1: 0.5, 2: 0.5, 3: 0.1}, 2) == [1, 2]
    assert safl.top_layers({0: 0.2, 1: 0.5, 2: 0.5, 3: 0.1}, 1) == [1]
    assert safl.top_layers({4: 0.3, 5: 0.3}, 1) == [4]
    with pytest.raises(ConfigError, match="1..2"):
        safl.top_layers({4: 0.3, 5: 0.3}, 3)


def test_profile_sample_is_seeded_per_site_and_round():
    a = safl.profile_indices(100, 10, safl.profile_seed(0, 1, "site-a"))
    assert len(set(a)) == 10 and list(a) == sorted(a)
    np.testing.assert_array_equal(a, safl.profile_indices(100, 10, safl.profile_seed(0, 1, "site-a")))
    assert list(a) != list(safl.profile_indices(100, 10, safl.profile_seed(0, 2, "site-a")))
    assert list(a) != list(safl.profile_indices(100, 10, safl.profile_seed(0, 1, "site-b")))
    np.testing.assert_array_equal(safl.profile_indices(5, 10, 3), np.arange(5))


def test_update_layer_check():
    safl.check_update_layers(["bert.encoder.layer.0.a", "bert.encoder.layer.0.b", "classifier.weight"], 1)
    with pytest.raises(IntegrityError, match="2 layers .*at most 1"):
        safl.check_update_layers(["bert.encoder.layer.0.a", "bert.encoder.layer.2.b"], 1)


# --------------------------------------------------------------------------------------------------------------
# validation: SDK task, aggregator, simulator


def _task(**kw) -> Task:
    base = dict(name="safl", dataset="notes", labels=LABELS, architecture="transformer", selection="safl",
                safl_top_k=2)
    base.update(kw)
    return Task(**base)


@pytest.mark.parametrize("kw,message", [
    (dict(architecture="lstm"), "lstm has no attention layers to profile"),
    (dict(family="token-classification", architecture="cnn-bilstm-crf"), "no attention layers"),
    (dict(safl_top_k=0), "safl_top_k must be an integer >= 1"),
    (dict(safl_profile_samples=-1), "safl_profile_samples must be a whole number from 0 to 100000, got -1"),
    (dict(safl_token="sep"), "safl_token 'sep' is unknown"),
    (dict(safl_token="entities"), "applies to token-classification only"),
    (dict(selection="attention"), "update selection 'attention' is unknown"),
    (dict(selection="static"), "apply only with \\[update\\] selection = \"safl\""),
    (dict(strategy="weipro"), "weipro projects whole updates"),
    (dict(strategy="multi-krum", min_sites=5), "multi-krum compares whole updates"),
    (dict(strategy="dp-fedavg", privacy={"level": "client"}), "dp-fedavg divides every tensor"),
    (dict(strategy="dynamic-weighting"), "summed norms"),
    (dict(strategy="fedatt", strategy_params={"granularity": "whole_model"}), "granularity 'per_layer'"),
])
def test_task_refuses_what_safl_cannot_do(kw, message):
    with pytest.raises(ConfigError, match=message):
        _task(**kw).validate()


@pytest.mark.parametrize("strategy", ["fedavg", "fedavgm", "fedadam", "median", "trimmed-mean", "norm-bounded",
                                      "fedatt"])
def test_task_accepts_strategies_that_average_per_tensor(strategy):
    spec = _task(strategy=strategy, safl_token="last", safl_profile_samples=8).to_spec()
    assert (spec.update.selection, spec.update.select_top_k_layers, spec.update.safl_profile_samples,
            spec.update.safl_token) == ("safl", 2, 8, "last")
    cfg = safl.SaflConfig.from_spec(spec)
    assert cfg == safl.SaflConfig(top_k=2, profile_samples=8, token="last")
    default = safl.SaflConfig.from_spec(_task().to_spec())
    assert default == safl.SaflConfig(top_k=2, profile_samples=64, token="cls")
    assert safl.SaflConfig.from_spec(_task(selection="static", safl_top_k=0).to_spec()) is None


def test_task_toml_update_section(tmp_path):
    path = tmp_path / "task.toml"
    path.write_text('name = "t"\ndataset = "notes"\nlabels = ["a", "b"]\n[update]\nselection = "safl"\n'
                    'safl_top_k = 2\nsafl_profile_samples = 16\nsafl_token = "cls"\n')
    task = Task.from_toml(path)
    assert (task.selection, task.safl_top_k, task.safl_profile_samples, task.safl_token) == ("safl", 2, 16, "cls")
    path.write_text('name = "t"\ndataset = "notes"\nlabels = ["a", "b"]\n[update]\nselection = "safl"\n'
                    'safl_top_k = 0\n')
    with pytest.raises(ConfigError, match="safl_top_k must be an integer >= 1"):
        Task.from_toml(path)


def test_aggregator_refuses_top_k_beyond_the_model_and_bad_specs():
    from aggregator_service.rounds import validate_spec
    from fedclinic.errors import Refused

    pkg = bert_package(layers=3)
    validate_spec(_task(safl_top_k=3).to_spec(), pkg.manifest())
    with pytest.raises(Refused, match="safl_top_k is 4 but only 3 layer"):
        validate_spec(_task(safl_top_k=4).to_spec(), pkg.manifest())
    with pytest.raises(Refused, match="safl_top_k is 3 but only 2 layer"):
        validate_spec(_task(safl_top_k=3, frozen=[r"bert\.encoder\.layer\.0\..*"]).to_spec(), pkg.manifest())
    spec = _task().to_spec()  # an SDK of another version could send what this one refuses
    spec.update.select_top_k_layers = 0
    with pytest.raises(Refused, match="safl_top_k must be an integer >= 1"):
        validate_spec(spec, pkg.manifest())
    spec = _task().to_spec()
    spec.secure_aggregation.enabled = True  # runs: one weight slot per tensor (fedclinic.secagg.vector_layout)
    spec.secure_aggregation.min_cohort = 3
    validate_spec(spec, pkg.manifest())
    spec.strategy = "median"  # ...but a strategy that needs each site's update stays refused, with the reason
    with pytest.raises(Refused, match="secure aggregation reveals only the sum"):
        validate_spec(spec, pkg.manifest())
    spec = _task().to_spec()
    spec.strategy = "weipro"
    with pytest.raises(Refused, match="weipro projects whole updates"):
        validate_spec(spec, pkg.manifest())
    spec = _task().to_spec()
    spec.architecture = "lstm"
    with pytest.raises(Refused, match="no attention layers"):
        validate_spec(spec, pkg.manifest())


def test_aggregator_offers_layers_and_head_only():
    from aggregator_service.update_admission import sent_tensors

    pkg = bert_package(layers=2)
    names = sent_tensors(_task().to_spec(), pkg.manifest())
    assert names and all(safl.layer_of(n) is not None or n.startswith(("classifier.", "bert.pooler.")) for n in names)
    assert not any(n.startswith("bert.embeddings.") for n in names)
    static = sent_tensors(_task(selection="static", safl_top_k=0).to_spec(), pkg.manifest())
    assert any(n.startswith("bert.embeddings.") for n in static)


def test_simulator_refuses_safl_with_a_model_without_attention():
    from fedclinic.models import package_from_config, wordlevel_tokenizer_json
    from fedclinic.federation.simulate import simulate
    from fedclinic.training.trainer import TrainConfig

    pkg = package_from_config(architecture="logreg", labels=LABELS, tokenizer_json=wordlevel_tokenizer_json(WORDS),
                              config={}, max_length=16)
    with pytest.raises(ConfigError, match="logreg has no attention layers"):
        simulate(pkg, [examples(4)], rounds=1, train=TrainConfig(), safl=safl.SaflConfig(top_k=1))
    with pytest.raises(ConfigError, match="safl_top_k is 3 but only 2"):
        simulate(bert_package(layers=2), [examples(4)], rounds=1, train=TrainConfig(), safl=safl.SaflConfig(top_k=3))
    with pytest.raises(ConfigError, match="weipro"):
        simulate(bert_package(layers=2), [examples(4)], rounds=1, train=TrainConfig(), strategy="weipro",
                 safl=safl.SaflConfig(top_k=1))


# --------------------------------------------------------------------------------------------------------------
# the simulator


def _replay_round(start, site_rows, config, train, round_):
    """One SAFL round recomputed by hand: each site's selection, training and delta, then per-tensor FedAvg."""
    from dataclasses import replace

    from fedclinic.training import trainer as training
    from fedclinic.models import build_model, module_tensors
    from fedclinic.federation.site_round import site_seed

    sums: dict[str, np.ndarray] = {}
    weights: dict[str, float] = {}
    chosen = {}
    for i, rows in enumerate(site_rows):
        loaded = build_model(start)
        data = training.encode(rows, loaded, max_length=train.max_length)
        names = safl.sendable(list(start.tensors), loaded.family)
        choice = safl.select_layers(loaded, data, config, names, seed=safl.profile_seed(train.seed, round_, f"site-{i}"))
        chosen[i] = choice.layers
        before = module_tensors(loaded.module, choice.tensors)
        result = training.train_local(loaded, data, replace(train, seed=site_seed(train.seed, round_, f"site-{i}")),
                                      trainable=choice.tensors)
        delta = training.compute_delta(before, module_tensors(loaded.module, choice.tensors), choice.tensors)
        for name, d in delta.items():
            sums[name] = sums.get(name, 0.0) + result.num_samples * d.astype(np.float64)
            weights[name] = weights.get(name, 0.0) + result.num_samples
    new = {name: start.tensors[name] + sums[name] / weights[name] if name in sums else start.tensors[name]
           for name in start.tensors}
    return new, chosen


def test_simulated_safl_rounds_train_only_selected_layers_and_average_per_tensor():
    from fedclinic.transport.package import ModelPackage
    from fedclinic.federation.simulate import simulate
    from fedclinic.training.trainer import TrainConfig

    pkg = constructed_package(FLIP_CLS, FLIP_SEP)
    sites = [length_examples(12, 2, seed=0), length_examples(20, 10, seed=1), length_examples(16, 10, seed=2)]
    train = TrainConfig(batch_size=8, learning_rate=0.01, optimizer="sgd", max_length=16)
    config = safl.SaflConfig(top_k=1, profile_samples=6)
    result = simulate(pkg, sites, rounds=2, train=train, safl=config)
    expected, chosen = _replay_round(pkg, sites, config, train, 1)
    assert result.rounds[0].selected_layers == chosen == {0: [1], 1: [0], 2: [0]}  # short texts pick layer 1
    assert set(result.rounds[0].layer_scores[0]) == {0, 1, 2}
    after_one = ModelPackage(tensors={**pkg.tensors, **expected}, files=dict(pkg.files))
    expected2, chosen2 = _replay_round(after_one, sites, config, train, 2)
    assert result.rounds[1].selected_layers == chosen2
    for name, arr in expected2.items():
        np.testing.assert_allclose(result.package.tensors[name], arr, rtol=1e-5, atol=1e-6, err_msg=name)
    used = {layer for r in result.rounds for v in r.selected_layers.values() for layer in v}
    assert 2 not in used
    changed = {name for name, arr in pkg.tensors.items() if not np.array_equal(result.package.tensors[name], arr)}
    assert {"classifier.weight", "classifier.bias"} <= changed
    assert {safl.layer_of(n) for n in changed} == {None, 0, 1}      # the head and the layers sites chose
    assert not any(n.startswith("bert.embeddings.") for n in changed)
