"""The toy NER (token-classification) set: sentences with one drug and one condition mention, a word-level
tokenizer, tiny BERT packages (plain or CRF, BIO or BIOES), and the JSONL files and policy an NER site uses."""

from __future__ import annotations

import json
import random

from fedclinic.training import trainer as training

from fedclinic.data.ner import EntitySpan, NerExample
from fedclinic.models import wordlevel_tokenizer_json
from fedclinic.models.token_classification import package_ner_from_config
from fedclinic.transport.package import ModelPackage

DRUGS = ["aspirin", "ibuprofen", "metformin", "sertraline"]
CONDITIONS = ["headache", "diabetes", "depression", "back pain"]
FILLER = ["patient", "took", "for", "daily", "since", "with", "mild", "the", "week", "and"]
LABELS = ["DRUG", "CONDITION"]
TINY = {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 64}


def tokenizer() -> bytes:
    """A word-level tokenizer over the drugs, the condition words and the filler."""
    words = DRUGS + [w for c in CONDITIONS for w in c.split()] + FILLER
    return wordlevel_tokenizer_json(words)


def make_examples(n: int, seed: int) -> list[NerExample]:
    """Sentences of filler with one drug and one condition mention at random places."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = rng.sample(FILLER, 4)
        drug, cond = rng.choice(DRUGS), rng.choice(CONDITIONS)
        parts.insert(rng.randrange(len(parts) + 1), drug)
        parts.insert(rng.randrange(len(parts) + 1), cond)
        text = " ".join(parts)
        spans = []
        for phrase, label in ((drug, "DRUG"), (cond, "CONDITION")):
            i = text.find(phrase)
            spans.append(EntitySpan(i, i + len(phrase), label))
        out.append(NerExample(text, tuple(sorted(spans, key=lambda s: s.start))))
    return out


def package(architecture: str = "transformer", scheme: str = "BIO", seed: int = 0) -> ModelPackage:
    """A seeded tiny NER package (:data:`TINY` BERT, plain or ``transformer-crf``)."""
    return package_ner_from_config(labels=LABELS, tokenizer_json=tokenizer(), config=TINY, architecture=architecture,
                                   scheme=scheme, max_length=32, seed=seed)



def assert_learns_the_entities(model, learning_rate: float) -> tuple[str, list[dict]]:
    """Train every parameter of ``model`` for 12 epochs on 48 examples and check that it learned the toy entities
    (strict F1 from under 0.5 to over 0.9 on 24 held-out examples, lower loss, both mentions of a new sentence
    found); that sentence and the entities predicted for it."""
    train = training.encode(make_examples(48, seed=1), model)
    test = training.encode(make_examples(24, seed=2), model)
    before = training.evaluate(model, test)
    cfg = training.TrainConfig(local_epochs=12, batch_size=8, learning_rate=learning_rate, seed=0)
    training.train_local(model, train, cfg, trainable=[n for n, _ in model.module.named_parameters()])
    after = training.evaluate(model, test)
    assert before["strict_f1"] < 0.5
    assert after["strict_f1"] > 0.9, after
    assert after["loss"] < before["loss"]
    text = "patient took metformin for back pain"
    ents = model.predict_entities([text])[0]
    assert {(e["text"], e["label"]) for e in ents} == {("metformin", "DRUG"), ("back pain", "CONDITION")}
    return text, ents


NER_POLICY = {"allowed_families": ["token-classification"], "allowed_datasets": ["ner"]}


def write_jsonl(path, examples) -> None:
    """NER examples as JSONL rows ``{"text", "entities": [{"start", "end", "label"}]}``."""
    path.write_text("".join(json.dumps({"text": e.text, "entities": [{"start": s.start, "end": s.end,
                                                                       "label": s.label} for s in e.entities]}) + "\n"
                            for e in examples))
