"""The "feature-classification" model family: classification of fixed-length numeric feature vectors.

Used for tabular data (lab values, vitals, precomputed embeddings) and for the FedProx Synthetic(alpha, beta)
benchmark that FLCMC's experiments run on. One architecture today::

    {"format": 1, "family": "feature-classification", "architecture": "logreg", "labels": [...],
     "multi_label": false, "arch_config": {"num_features": 60}}

``logreg``
    Multinomial logistic regression, ``logits = x W^T + b`` (``torch.nn.Linear``). Tensors
    ``linear.weight`` (labels x features) and ``linear.bias``, initialised at zero (the problem is convex;
    FedProx's ``mclr`` starts at zero too).

Inputs are float32 ``[batch, num_features]``; :func:`encode_features` checks and packs them with labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models.meta import ModelMeta
from fedclinic.transport.package import META_FILE, ModelPackage, meta_bytes
from fedclinic.models.base import load_strict, module_tensors

if TYPE_CHECKING:  # pragma: no cover
    import torch

FAMILY = "feature-classification"
FORMAT = 1
ARCHITECTURES = ("logreg",)


@dataclass
class FeatureModel(ModelMeta):
    """A built feature-classification model: the torch module and the parsed ``fedclinic_model.json``."""

    module: "torch.nn.Module"
    meta: dict

    @property
    def num_features(self) -> int:
        return int(self.meta["arch_config"]["num_features"])

    def logits(self, features: "torch.Tensor") -> "torch.Tensor":
        """``[batch, num_features]`` float32 -> ``[batch, num_labels]`` logits."""
        return self.module(features)


@dataclass
class FeatureData:
    """Feature vectors and labels as CPU tensors, ready for :func:`fedclinic.training.trainer.train_local`."""

    features: "torch.Tensor"   # [N, d] float32
    labels: "torch.Tensor"     # [N] int64 class indices, or [N, C] float32 multi-hot
    multi_label: bool
    num_labels: int

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def batch(self, idx: "torch.Tensor", device: "torch.device") -> tuple[tuple["torch.Tensor", ...], "torch.Tensor"]:
        """(model inputs, targets) of the examples at ``idx`` on ``device``."""
        nb = device.type == "cuda"
        return (self.features[idx].to(device, non_blocking=nb),), self.labels[idx].to(device, non_blocking=nb)

    def batches(self, order: "torch.Tensor", batch_size: int, device: "torch.device"):
        """One epoch in ``order``: rows are gathered (and moved) once, then each batch is a view of a slice."""
        x, y = self.batch(order, device)
        x = x[0]
        for start in range(0, len(order), batch_size):
            yield (x[start:start + batch_size],), y[start:start + batch_size]


def _linear_module(num_features: int, num_labels: int):
    import torch
    from torch import nn

    class LogReg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(num_features, num_labels)
            nn.init.zeros_(self.linear.weight)
            nn.init.zeros_(self.linear.bias)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.linear(features)

    return LogReg()


def package_feature_model(*, num_features: int, labels: Sequence[str], architecture: str = "logreg",
                          multi_label: bool = False) -> ModelPackage:
    """A fresh (zero-initialised) model over ``num_features`` inputs predicting ``labels``."""
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; choose one of "
                          f"{', '.join(ARCHITECTURES)}")
    if not isinstance(num_features, int) or num_features < 1:
        raise ConfigError(f"num_features must be an integer >= 1, got {num_features!r}")
    labels = [str(x) for x in labels]
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise ConfigError(f"labels must be at least two distinct names, got {labels}")
    meta: dict[str, Any] = {"format": FORMAT, "family": FAMILY, "architecture": architecture, "labels": labels,
                            "multi_label": bool(multi_label), "arch_config": {"num_features": num_features}}
    module = _linear_module(num_features, len(labels))
    files = {META_FILE: meta_bytes(meta)}
    return ModelPackage(tensors=module_tensors(module), files=files)


def build(package: ModelPackage) -> FeatureModel:
    """Build the module of a feature-classification package and load its tensors strictly."""
    meta = package.meta
    if meta.get("architecture") not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {meta.get('architecture')!r} for family {FAMILY!r}; choose one "
                          f"of {', '.join(ARCHITECTURES)}")
    labels = meta.get("labels")
    num_features = (meta.get("arch_config") or {}).get("num_features")
    if not isinstance(labels, list) or len(labels) < 2:
        raise IntegrityError(f"{META_FILE} needs a list of at least two labels")
    if not isinstance(num_features, int) or num_features < 1:
        raise IntegrityError(f"{META_FILE} arch_config needs num_features (an integer >= 1)")
    module = _linear_module(num_features, len(labels))
    load_strict(module, package.tensors)
    module.eval()
    return FeatureModel(module=module, meta=meta)


def encode_features(x: np.ndarray, y: np.ndarray, model: FeatureModel) -> FeatureData:
    """Pack ``x`` ([N, d] numbers) and ``y`` ([N] class indices, or [N, C] 0/1 when multi-label) for training.

    Raises DatasetError naming the first bad row: wrong width, a non-finite value, an out-of-range label.
    """
    import torch

    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim != 2 or x.shape[1] != model.num_features:
        raise DatasetError(f"features must be [rows, {model.num_features}], got shape {x.shape}")
    if len(x) == 0:
        raise DatasetError("no examples; the feature matrix is empty")
    if len(y) != len(x):
        raise DatasetError(f"{len(x)} feature rows but {len(y)} labels")
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if bad.size:
        raise DatasetError(f"row {int(bad[0])}: non-finite feature value (NaN or Inf); clean or impute the data")
    c = len(model.labels)
    if model.multi_label:
        if y.shape != (len(x), c) or not np.isin(y, (0, 1)).all():
            raise DatasetError(f"multi-label targets must be a 0/1 matrix [rows, {c}], got shape {y.shape}")
        labels = torch.from_numpy(y.astype(np.float32))
    else:
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DatasetError(f"labels must be class indices (integers) of shape [rows], got {y.dtype} {y.shape}")
        out = np.flatnonzero((y < 0) | (y >= c))
        if out.size:
            raise DatasetError(f"row {int(out[0])}: label {int(y[out[0]])} is outside 0..{c - 1} ({c} labels)")
        labels = torch.from_numpy(y.astype(np.int64))
    return FeatureData(features=torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), labels=labels,
                       multi_label=model.multi_label, num_labels=c)
