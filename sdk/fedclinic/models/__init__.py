"""Model families: build a torch module from a :class:`~fedclinic.transport.package.ModelPackage`, and package models.

A package names its family in ``fedclinic_model.json``; :func:`build_model` dispatches on it through
:data:`FAMILIES`. Only built-in families and architectures exist: a package carries tensors and JSON, never
code. Families register in :mod:`.families` (``register_family``, re-exported here): "text-classification", "feature-classification",
"token-classification" (NER), "question-answering" (a causal LM that answers by generation) and
"image-text-classification" (an image and its report -> multi-label findings: ResNet + BiLSTM, IU-CXR).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedclinic.errors import FedclinicError
from fedclinic.models import lora
from fedclinic.models.causal_lm import package_qa_pretrained
from fedclinic.models.families import FAMILIES, SUPPORTED_FORMAT, builder_for, register_family
from fedclinic.models.image_text import package_image_text_pretrained
from fedclinic.models.text_classification import (
    ALLOWED_MODEL_TYPES,
    ARCHITECTURES,
    LSTM_DEFAULTS,
    LoadedModel,
    load_tensors,
    load_tokenizer,
    module_tensors,
    package_from_config,
    package_pretrained,
    tokenizer_pad_id,
    wordlevel_tokenizer_json,
)
from fedclinic.models.token_classification import package_ner_pretrained
from fedclinic.transport.package import ModelPackage

if TYPE_CHECKING:  # pragma: no cover
    from fedclinic.spec.task import Task


def build_model(package: ModelPackage) -> Any:
    """Build the package's module and load its tensors strictly (CPU, eval mode).

    Raises ConfigError for an unknown family/architecture/model_type (listing the allowed ones) and
    IntegrityError when the tensors do not match the declared model (naming the missing, unexpected or
    mis-shaped tensors).
    """
    builder = builder_for(package)
    meta = package.meta
    spec = lora.spec_of(meta)
    if spec is None:
        return builder(package)
    base, adapters = lora.split(package)  # the base model loads strictly, then its adapters attach
    loaded = builder(base)
    lora.attach(loaded.module, spec, adapters)
    loaded.meta = meta
    return loaded


def package_for_task(task: Task) -> ModelPackage:
    """The initial model package of ``task``: its pretrained folder (``task.model``) packaged for its family.

    Needs the ``[train]`` extra (torch, transformers). Nothing is downloaded.
    """
    if not task.model:
        raise FedclinicError("the task names no model folder; set Task.model or pass package=")
    if task.family == "question-answering":
        return package_qa_pretrained(task.model, max_length=task.max_length, config=task.model_config or None)
    if task.family == "token-classification":
        return package_ner_pretrained(task.model, labels=task.labels, architecture=task.architecture,
                                      scheme=task.tag_scheme, max_length=task.max_length, seed=task.seed,
                                      config=task.model_config or None)
    if task.family == "image-text-classification":
        return package_image_text_pretrained(task.model, labels=task.labels, max_length=task.max_length,
                                             seed=task.seed, config=task.model_config or None)
    return package_pretrained(task.model, labels=task.labels, architecture=task.architecture,
                              multi_label=task.multi_label, max_length=task.max_length, seed=task.seed,
                              config=task.model_config or None)


__all__ = [
    "ALLOWED_MODEL_TYPES",
    "ARCHITECTURES",
    "FAMILIES",
    "LSTM_DEFAULTS",
    "LoadedModel",
    "SUPPORTED_FORMAT",
    "build_model",
    "load_tensors",
    "load_tokenizer",
    "module_tensors",
    "package_for_task",
    "package_from_config",
    "package_pretrained",
    "register_family",
    "tokenizer_pad_id",
    "wordlevel_tokenizer_json",
]
