"""The registry of built-in model families: which builder turns a package of each family into a loaded model.

:func:`builder_for` reads a package's ``fedclinic_model.json`` and returns its family's builder, refusing an
unknown format or family with what to do. :func:`fedclinic.models.build_model` uses it and then attaches LoRA
adapters (:mod:`fedclinic.models.lora`); :func:`fedclinic.models.lora.add_adapters` uses it to build the base
model it adds adapters to. Only built-in families exist: a package carries tensors and JSON, never code.
"""

from __future__ import annotations

from typing import Any, Callable

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import causal_lm, feature_classification, image_text, text_classification, token_classification
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


def builder_for(package: ModelPackage) -> Callable[[ModelPackage], Any]:
    """The builder of the package's family.

    Raises IntegrityError when the package has no ``fedclinic_model.json`` and ConfigError for an unsupported
    format or an unknown family (listing the supported ones).
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
    return builder
