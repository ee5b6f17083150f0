"""Tiny image-text-classification (ResNet + BiLSTM) packages on the imaging stand-in set
(:mod:`fedclinic.assets.imaging_standin`): the config, examples written to a folder, and a briefly trained package."""

from __future__ import annotations

from fedclinic.assets.imaging_standin import STANDIN_LABELS, standin_tokenizer_json, write_standin
from fedclinic.data.text import read_dataset
from fedclinic.models import build_model
from fedclinic.models.image_text import FAMILY, package_image_text_from_config
from fedclinic.transport.package import ModelPackage

LABELS = list(STANDIN_LABELS)
TINY = {"image_size": 32, "resnet_embedding_size": 8, "resnet_hidden_sizes": [8, 16], "resnet_depths": [1, 1],
        "resnet_layer_type": "basic", "embedding_dim": 16, "lstm_hidden": 16, "branch_hidden": 16, "branch_dim": 8,
        "fusion_hidden": 16, "dropout": 0.0}


def package(seed: int = 0, **overrides) -> ModelPackage:
    """A seeded tiny package (:data:`TINY`, ``overrides`` on top)."""
    return package_image_text_from_config(labels=LABELS, tokenizer_json=standin_tokenizer_json(),
                                          config={**TINY, **overrides}, max_length=16, seed=seed)


def examples(folder, n: int, seed: int, image_format: str = "png"):
    """``n`` stand-in examples written under ``folder`` and read back as the family's dataset."""
    manifest = write_standin(folder, n=n, seed=seed, image_format=image_format)
    return read_dataset(FAMILY, manifest, label_set=LABELS, label_field="labels")


def trained_package(folder, seed: int = 3) -> ModelPackage:
    """A tiny image-text model trained briefly on 32 stand-in examples (so that its label decisions differ between
    inputs; an untrained model says the same for everything), as a package."""
    from fedclinic.training import trainer as training
    from fedclinic.models import module_tensors

    start = package(seed=seed)
    model = build_model(start)
    data = training.encode(examples(folder, 32, seed=1), model)
    training.train_local(model, data, training.TrainConfig(local_epochs=5, batch_size=8, learning_rate=1e-2, seed=0),
                         trainable=list(start.tensors))
    return ModelPackage(module_tensors(model.module), start.files)
