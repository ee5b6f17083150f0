"""The token-classification (NER) family: packaging, building, encoding, training, evaluation, simulation."""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.training import trainer as training
from fedclinic.data.ner import EntitySpan, NerExample
from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models import build_model
from fedclinic.transport.package import META_FILE, ModelPackage
from fedclinic.federation.simulate import simulate

from tests.helpers.ner_models import assert_learns_the_entities, make_examples, package


@pytest.mark.parametrize("architecture", ["transformer", "transformer-crf"])
@pytest.mark.parametrize("scheme", ["BIO", "BIOES"])
def test_training_learns_the_entities(architecture, scheme):
    model = build_model(package(architecture, scheme))
    assert model.tags[0] == "O" and len(model.tags) == (5 if scheme == "BIO" else 9)
    text, ents = assert_learns_the_entities(model, learning_rate=5e-3)
    # predictions come back as character spans of the input text
    assert all(text[e["start"]:e["end"]] == e["text"] for e in ents)


def test_crf_model_has_transition_tensors_and_rebuilds_identically():
    pkg = package("transformer-crf")
    assert {"crf.transitions", "crf.start_transitions", "crf.end_transitions"} <= set(pkg.tensors)
    assert pkg.tensors["crf.transitions"].shape == (5, 5)
    again = package("transformer-crf")
    assert pkg.manifest().model_hash == again.manifest().model_hash  # seeded: same seed, same package


def test_encoding_tags_subword_tokens_and_specials():
    model = build_model(package())
    ex = NerExample("patient took aspirin", (EntitySpan(13, 20, "DRUG"),))
    data = training.encode([ex], model)
    tags = [model.tags[int(i)] for i in data.labels[0] if int(i) >= 0]
    assert tags == ["O", "O", "O", "B-DRUG", "O"]  # [CLS] patient took aspirin [SEP]
    assert data.gold == [[("DRUG", 3, 4)]]


def test_unknown_entity_type_and_wrong_data_are_refused():
    model = build_model(package())
    with pytest.raises(DatasetError, match=r"entity type\(s\) \['DOSE'\] not in the model's labels"):
        training.encode([NerExample("take aspirin", (EntitySpan(5, 12, "DOSE"),))], model)
    from fedclinic.data.text import Example

    with pytest.raises(DatasetError, match="not an NER example"):
        training.encode([Example("take aspirin", ("DRUG",))], model)
    with pytest.raises(DatasetError, match="empty"):
        training.encode([], model)


def test_bad_packages_are_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="unknown architecture 'lstm-crf'"):
        package("lstm-crf")
    with pytest.raises(ConfigError, match="unknown tag scheme 'IOB1'"):
        package(scheme="IOB1")
    pkg = package()
    import json

    meta = json.loads(pkg.files[META_FILE])
    meta["tags"] = meta["tags"][:-1]
    broken = ModelPackage(pkg.tensors, {**pkg.files, META_FILE: json.dumps(meta).encode()})
    with pytest.raises(IntegrityError, match="re-package the model"):
        build_model(broken)
    missing = ModelPackage({k: v for k, v in pkg.tensors.items() if k != "classifier.bias"}, pkg.files)
    with pytest.raises(IntegrityError, match="missing tensor"):
        build_model(missing)


def test_simulator_trains_ner_federated():
    sites = [make_examples(32, seed=10 + i) for i in range(3)]
    result = simulate(package("transformer-crf"), sites, rounds=3,
                      train=training.TrainConfig(local_epochs=3, batch_size=8, learning_rate=5e-3),
                      eval_data=make_examples(24, seed=99))
    f1 = [r.metrics["strict_f1"] for r in result.rounds]
    assert result.initial_metrics["strict_f1"] < 0.5
    assert f1[-1] > 0.9, f1
    assert np.isfinite([r.train_loss for r in result.rounds]).all()
