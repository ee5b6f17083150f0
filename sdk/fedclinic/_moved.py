"""Module paths that moved when the SDK was split into subpackages (0.2), importable for one release.

``import fedclinic.wire`` still works and returns :mod:`fedclinic.transport.wire` itself (one module object, so
state and ``isinstance`` checks are shared), with a :class:`DeprecationWarning` naming the new path. Where an old
module became a package of the same name (``fedclinic.data``, ``fedclinic.training``, ``fedclinic.export``,
``fedclinic.serving``), the package resolves the old module's public names lazily through :func:`moved_attribute`.
Remove this module, and the ``__getattr__`` hooks that call it, in the release after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

#: old module path -> new module path
MOVED_MODULES: dict[str, str] = {
    "fedclinic.audit": "fedclinic.runtime.audit_log",
    "fedclinic.blobstore": "fedclinic.runtime.blobstore",
    "fedclinic.durable_file": "fedclinic.runtime.durable_file",
    "fedclinic.failpoints": "fedclinic.runtime.failpoints",
    "fedclinic.logs": "fedclinic.runtime.logs",
    "fedclinic.metrics_endpoint": "fedclinic.runtime.metrics_endpoint",
    "fedclinic.tomlconfig": "fedclinic.runtime.tomlconfig",
    "fedclinic.wire": "fedclinic.transport.wire",
    "fedclinic.codec_wire": "fedclinic.transport.codec_wire",
    "fedclinic.downlink": "fedclinic.transport.downlink",
    "fedclinic.rpc": "fedclinic.transport.rpc",
    "fedclinic.package": "fedclinic.transport.package",
    "fedclinic.task": "fedclinic.spec.task",
    "fedclinic.selection": "fedclinic.spec.selection",
    "fedclinic.model_card": "fedclinic.spec.model_card",
    "fedclinic.data_image": "fedclinic.data.image",
    "fedclinic.data_ner": "fedclinic.data.ner",
    "fedclinic.data_qa": "fedclinic.data.qa",
    "fedclinic.partition": "fedclinic.data.partition",
    "fedclinic.ner_tags": "fedclinic.data.ner_tags",
    "fedclinic.qa_generation": "fedclinic.data.qa_prompt",
    "fedclinic.datasets": "fedclinic.assets",
    "fedclinic.datasets.drugreview": "fedclinic.assets.drugreview",
    "fedclinic.datasets.imaging_standin": "fedclinic.assets.imaging_standin",
    "fedclinic.datasets.silver_ner": "fedclinic.assets.silver_ner",
    "fedclinic.datasets.smollm2": "fedclinic.assets.smollm2",
    "fedclinic.datasets.synthetic": "fedclinic.assets.synthetic",
    "fedclinic.lora": "fedclinic.models.lora",
    "fedclinic.generation_metrics": "fedclinic.evaluation.generation",
    "fedclinic.multilabel_metrics": "fedclinic.evaluation.multilabel",
    "fedclinic.optimizers": "fedclinic.training.optimizers",
    "fedclinic.safl": "fedclinic.training.safl",
    "fedclinic.private_modules": "fedclinic.training.private_modules",
    "fedclinic.onnx_causal_lm": "fedclinic.export.causal_lm",
    "fedclinic.onnx_crf": "fedclinic.export.crf",
    "fedclinic.onnx_encoder_fusion": "fedclinic.export.encoder_fusion",
    "fedclinic.onnx_encoder_int8": "fedclinic.export.encoder_int8",
    "fedclinic.serve": "fedclinic.serving.http_server",
    "fedclinic.onnx_generate": "fedclinic.serving.generate",
    "fedclinic.simulate": "fedclinic.federation.simulate",
    "fedclinic.localfed": "fedclinic.federation.local_federation",
    "fedclinic.experiment": "fedclinic.federation.experiment",
    "fedclinic.demo": "fedclinic.federation.demo",
    "fedclinic.credentials": "fedclinic.pki.credentials",
}

#: package that replaced a module of the same name -> (module now holding its names, the names)
MOVED_NAMES: dict[str, tuple[str, frozenset[str]]] = {
    "fedclinic.data": ("fedclinic.data.text", frozenset({
        "FORMATS", "MULTI_LABEL_SEPARATOR", "Example", "infer_format", "read_classification", "require_text",
        "read_dataset", "jsonl_objects",
    })),
    "fedclinic.training": ("fedclinic.training.trainer", frozenset({
        "TrainConfig", "EncodedData", "TrainResult", "select_device", "select_tensors", "encode",
        "train_local", "gradient_change_rate", "evaluate", "compute_delta",
    })),
    "fedclinic.export": ("fedclinic.export.onnx_export", frozenset({
        "OPSET", "IMAGE_TEXT", "FP32_TOLERANCE", "QA_FP32_TOLERANCE", "INT8_TOLERANCE", "INT8_TOKEN_TOLERANCE",
        "INT8_MIN_AGREEMENT", "ParityResult", "ExportReport", "ParityError", "parity_inputs", "check_parity",
        "export_onnx", "quantize_int8", "torch_paths", "check_paths", "add_export_commands",
    })),
    "fedclinic.serving": ("fedclinic.serving.bundle", frozenset({
        "QA_FAMILY", "IMAGE_TEXT_FAMILY", "TEXT_FAMILIES", "ImageInput", "ImagePreprocessing",
        "ClassifierBundle",
    })),
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes away in the next release)",
                  DeprecationWarning, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path by importing the new module and putting that very module in ``sys.modules``."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)  # a placeholder: exec_module swaps in the real module

    def exec_module(self, module: types.ModuleType) -> None:
        _warn(module.__name__, self.new)
        sys.modules[module.__name__] = importlib.import_module(self.new)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`MOVED_MODULES` under their old names."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put :class:`MovedModuleFinder` first on ``sys.meta_path``, once (called by ``fedclinic/__init__.py``).

    First, because an old submodule path under an aliased package (``fedclinic.datasets.drugreview``) would
    otherwise be found by the ordinary path finder through the package's ``__path__`` and loaded a second
    time as a separate module.
    """
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_attribute(package: str, name: str) -> Any:
    """``package.name`` for a name the old module ``package`` defined (the package's ``__getattr__``).

    Raises AttributeError for any other name, without importing anything, so that ``from package import
    submodule`` still finds the submodule.
    """
    target, names = MOVED_NAMES[package]
    if name not in names:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn(f"{package}.{name}", f"{target}.{name}")
    return getattr(importlib.import_module(target), name)
