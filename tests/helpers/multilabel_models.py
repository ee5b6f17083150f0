"""A skewed multi-label text set: ``cardio`` or ``neuro`` on every row, and a rare ``seizure`` finding (the word
"seizure" in the note) on a few percent of rows, a different share at each site; a tiny multi-label logreg trained
on it ranks ``seizure`` perfectly (AUC 1) while its probability stays below 0.5 (measured 0.09-0.34)."""

from __future__ import annotations

import random

from tests.helpers.text_models import FILLER, tiny_tokenizer_json

LABELS = ["cardio", "neuro", "seizure"]
CARDIO = ["heart", "chest", "pressure", "angina"]
NEURO = ["migraine", "tremor", "numbness", "dizziness"]
#: (rows, share of rows with the rare finding) of each site's validation split; the last site has none
SITES = {"north": (120, 0.03), "south": (80, 0.08), "west": (60, 0.0)}


def rows(n: int, seed: int, rare: float):
    """``n`` Examples: labels in turn cardio / neuro with two of their words and three filler words; each row
    also has ``seizure`` (label and word) with probability ``rare``."""
    from fedclinic.data.text import Example

    rng = random.Random(seed)
    out = []
    for i in range(n):
        label = ("cardio", "neuro")[i % 2]
        words = rng.sample(CARDIO if label == "cardio" else NEURO, 2) + rng.sample(FILLER, 3)
        labels = [label]
        if rng.random() < rare:
            labels.append("seizure")
            words.append("seizure")
        rng.shuffle(words)
        out.append(Example(" ".join(words), tuple(labels)))
    return out


def trained_model(seed: int = 0):
    """(package, loaded model) of a multi-label logreg trained on 300 rows, 3 % of them with ``seizure``."""
    from fedclinic.models import build_model, package_from_config
    from fedclinic.models.base import module_tensors
    from fedclinic.training.trainer import TrainConfig, encode, train_local
    from fedclinic.transport.package import ModelPackage

    pkg = package_from_config(architecture="logreg", labels=LABELS, tokenizer_json=tiny_tokenizer_json(), config={},
                              multi_label=True, max_length=16, seed=seed)
    model = build_model(pkg)
    train_local(model, encode(rows(300, 1, 0.03), model),
                TrainConfig(learning_rate=0.05, local_epochs=2, batch_size=16, seed=seed), trainable=list(pkg.tensors))
    return ModelPackage(tensors=module_tensors(model.module), files=pkg.files), model
