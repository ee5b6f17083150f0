"""Model families: build a torch module from a :class:`~fedclinic.transport.package.ModelPackage`, and package models.

A package names its family in ``fedclinic_model.json``; :func:`build_model` dispatches on it through
:data:`FAMILIES`. Only built-in families and architectures exist: a package carries tensors and JSON, never
code. Families register here (``register_family``): "text-classification", "feature-classification",
"token-classification" (NER), "question-answering" (a causal LM that answers by generation) and
"image-text-classification" (an image and its report -> multi-label findings: ResNet + BiLSTM, IU-CXR).
"""

from __future__ import annotations

from typing import Any, Callable

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import (causal_lm, feature_classification, image_text, text_classification,
                              token_classification)
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
from fedclinic.transport.package import META_FILE, ModelPackage

SUPPORTED_FORMAT = 1

#: family name -> builder(package) -> a loaded model (``.module``, ``.labels``, ``.multi_label``, ``.logits(*inputs)``)
FAMILIES: dict[str, Callable[[ModelPackage], Any]] = {
    text_classification.FAMILY: text_classification.build,
    feature_classification.FAMILY: feature_classification.build,
    token_classification.FAMILY: token_classification.build,
    causal_lm.FAMILY: causal_lm.build,
    image_text.FAMILY: image_text.build,
}


def register_family(name: str, builder: Callable[[ModelPackage], Any]) -> None:
    """Add a built-in model family (called by fedclinic's own family modules)."""
    FAMILIES[name] = builder


def build_model(package: ModelPackage) -> Any:
    """Build the package's module and load its tensors strictly (CPU, eval mode).

    Raises ConfigError for an unknown family/architecture/model_type (listing the allowed ones) and
    IntegrityError when the tensors do not match the declared model (naming the missing, unexpected or
    mis-shaped tensors).
    """
    meta = package.meta
    if not meta:
        raise IntegrityError(f"the package has no {META_FILE}; package models with fedclinic.models."
                             "package_pretrained() or package_from_config()")
    fmt = meta.get("format")
    if fmt != SUPPORTED_FORMAT:
        raise ConfigError(f"{META_FILE} format {fmt!r} is not supported (this fedclinic reads format "
                          f"{SUPPORTED_FORMAT}); upgrade fedclinic or re-package the model")
    family = meta.get("family")
    builder = FAMILIES.get(family)
    if builder is None:
        raise ConfigError(f"unknown model family {family!r}; supported families: {', '.join(sorted(FAMILIES))}")
    from fedclinic.models import lora

    spec = lora.spec_of(meta)
    if spec is None:
        return builder(package)
    base, adapters = lora.split(package)  # the base model loads strictly, then its adapters attach
    loaded = builder(base)
    lora.attach(loaded.module, spec, adapters)
    loaded.meta = meta
    return loaded


__all__ = [
    "ALLOWED_MODEL_TYPES",
    "ARCHITECTURES",
    "FAMILIES",
    "LSTM_DEFAULTS",
    "LoadedModel",
    "build_model",
    "load_tensors",
    "load_tokenizer",
    "module_tensors",
    "package_from_config",
    "package_pretrained",
    "register_family",
    "tokenizer_pad_id",
    "wordlevel_tokenizer_json",
]
