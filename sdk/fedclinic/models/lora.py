"""LoRA adapters (Hu et al. 2021) on a model package: only the adapters (and the task head) train and travel.

A target ``nn.Linear`` with weight ``W`` (``[out, in]``) gets two tensors, ``A`` (``[r, in]``) and ``B``
(``[out, r]``), and computes ``y = x W^T + b + (alpha / r) * x A^T B^T``. ``B`` starts at zero, so the adapted
model starts equal to the base model; ``A`` starts like ``nn.Linear``'s own weight (Kaiming-uniform, a = sqrt(5))
from a seeded generator, so every site and the aggregator hold the same initial adapters. Merging writes
``W + (alpha / r) * B A`` into ``W`` and drops the adapters: the merged model computes the same function.

Package contract: ``fedclinic_model.json`` carries ``"lora": {"rank", "alpha", "targets", "seed"}`` and the
package holds, next to every unchanged base tensor, ``<linear>.lora_A`` and ``<linear>.lora_B`` for each target
linear (``targets``: regular expressions matched in full against the linear's module name).
:func:`fedclinic.models.build_model` builds the base model from the base tensors, then :func:`attach` adds the
adapters as parameters of the target linears (so they appear under exactly those names in ``state_dict()``,
and the trainer, the tensor selection, the codecs and the aggregator treat them like any other tensor).

Why not ``peft``: it wraps each target linear, renaming its weight ``<linear>.base_layer.weight``. fedclinic's
tensors are identified by name end to end (content-addressed downlink, per-tensor selection, private modules,
error feedback, secure-aggregation layouts), so a renaming layer would sit between every one of them and the
model; the adapter itself is the two matrices above.

DP-SGD trains adapters with exact per-example clipping: ghost clipping has a layer rule for an adapted linear
(:func:`fedclinic.privacy.ghost.lora_squared_norms`; it reads ``SCALING_ATTR``, the plain float attribute that
holds ``alpha / r`` on each target linear and that the forward hook uses too, so both read one value), and the
per-example loop (:mod:`fedclinic.privacy.per_example_clipping`) differentiates each example alone. Opacus' hooks
mode is refused for adapters (its Linear grad sampler covers a linear's own weight and bias only).
Not supported: adapter dropout (adapters are trained without it).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.families import builder_for
from fedclinic.transport.package import META_FILE, ModelPackage, meta_bytes

META_KEY = "lora"
A_SUFFIX, B_SUFFIX = ".lora_A", ".lora_B"
#: attribute of an adapted linear holding ``alpha / r`` (a float, not a tensor: it is not in ``state_dict()``)
SCALING_ATTR = "lora_scaling"


@dataclass(frozen=True)
class LoraSpec:
    """Adapter rank ``r``, scale numerator ``alpha`` (the update is scaled by ``alpha / r``), the target linears
    (full-match regular expressions on module names, e.g. ``r".*attention\\.self\\.(query|value)"``) and the seed
    of ``A``'s initialisation."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = (r".*\.attention\.self\.(query|value)",)
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> "LoraSpec":
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.targets, str) or not self.targets:
            raise ConfigError("LoRA targets must be a non-empty list of regular expressions over module names")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"LoRA target {pattern!r} is not a valid regular expression ({exc})") from None
        return self

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> "LoraSpec":
        if not isinstance(raw, Mapping):
            raise IntegrityError(f"{META_FILE} 'lora' must be an object with rank, alpha, targets and seed")
        unknown = sorted(set(raw) - {"rank", "alpha", "targets", "seed"})
        if unknown:
            raise IntegrityError(f"{META_FILE} 'lora' has unknown keys {unknown}")
        try:
            return cls(rank=raw["rank"], alpha=float(raw["alpha"]), targets=tuple(raw["targets"]),
                       seed=int(raw.get("seed", 0))).validate()
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"{META_FILE} 'lora' is malformed ({exc})") from None


def spec_of(package_or_meta: ModelPackage | Mapping[str, Any]) -> LoraSpec | None:
    """The package's adapter spec, or None when it has no adapters."""
    meta = package_or_meta.meta if isinstance(package_or_meta, ModelPackage) else package_or_meta
    raw = meta.get(META_KEY)
    return None if raw is None else LoraSpec.from_json(raw)


def is_adapter(name: str) -> bool:
    return name.endswith(A_SUFFIX) or name.endswith(B_SUFFIX)


def target_linears(module: Any, spec: LoraSpec) -> list[tuple[str, Any]]:
    """``(name, nn.Linear)`` for every linear of ``module`` whose module name fully matches a target."""
    import torch

    patterns = [re.compile(p) for p in spec.targets]
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, torch.nn.Linear) and any(p.fullmatch(name) for p in patterns)]


def add_adapters(package: ModelPackage, spec: LoraSpec) -> ModelPackage:
    """A copy of ``package`` with freshly initialised adapters on the linears ``spec`` targets.

    Raises ConfigError when the package already has adapters or no linear matches (listing some that exist)."""
    import torch  # lazy: importing fedclinic.models must not import torch

    spec.validate()
    if spec_of(package) is not None:
        raise ConfigError("the package already has LoRA adapters; merge them (fedclinic.models.lora.merge) before adding new ones")
    module = builder_for(package)(package).module  # the package has no adapters: its family's builder alone
    targets = target_linears(module, spec)
    if not targets:
        linears = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
        raise ConfigError(f"no linear layer matches the LoRA targets {list(spec.targets)}; linear layers of this "
                          f"model include {linears[:6]}")
    generator = torch.Generator().manual_seed(spec.seed)
    tensors = dict(package.tensors)
    for name, linear in targets:
        a = torch.empty(spec.rank, linear.in_features)
        _kaiming_uniform_(a, generator)
        tensors[name + A_SUFFIX] = a.numpy()
        tensors[name + B_SUFFIX] = np.zeros((linear.out_features, spec.rank), np.float32)
    return _with_meta(package, tensors, {**package.meta, META_KEY: spec.to_json()})


def split(package: ModelPackage) -> tuple[ModelPackage, dict[str, np.ndarray]]:
    """The base package (adapters and the ``lora`` key removed) and the adapter tensors."""
    meta = {k: v for k, v in package.meta.items() if k != META_KEY}
    base = {n: t for n, t in package.tensors.items() if not is_adapter(n)}
    adapters = {n: t for n, t in package.tensors.items() if is_adapter(n)}
    return _with_meta(package, base, meta), adapters


def attach(module: Any, spec: LoraSpec, adapters: Mapping[str, np.ndarray]) -> None:
    """Give each target linear of ``module`` its adapters (as parameters ``lora_A``/``lora_B``) and the forward
    hook that adds ``scaling * x A^T B^T``. Strict: every target needs both tensors with the right shapes, and
    no adapter may name a linear that is not a target (IntegrityError otherwise)."""
    import torch

    expected: set[str] = set()
    for name, linear in target_linears(module, spec):
        a_name, b_name = name + A_SUFFIX, name + B_SUFFIX
        expected |= {a_name, b_name}
        shapes = {a_name: (spec.rank, linear.in_features), b_name: (linear.out_features, spec.rank)}
        for tensor_name, shape in shapes.items():
            if tensor_name not in adapters:
                raise IntegrityError(f"LoRA adapter {tensor_name} is missing from the package")
            if tuple(adapters[tensor_name].shape) != shape:
                raise IntegrityError(f"LoRA adapter {tensor_name} has shape {tuple(adapters[tensor_name].shape)}, "
                                     f"expected {shape} (rank {spec.rank})")
        dtype = linear.weight.dtype
        linear.lora_A = torch.nn.Parameter(torch.tensor(np.asarray(adapters[a_name]), dtype=dtype))
        linear.lora_B = torch.nn.Parameter(torch.tensor(np.asarray(adapters[b_name]), dtype=dtype))
        setattr(linear, SCALING_ATTR, float(spec.scaling))
        linear.register_forward_hook(_hook)
    unexpected = sorted(set(adapters) - expected)
    if unexpected:
        raise IntegrityError(f"LoRA adapters {unexpected[:4]} belong to no target linear of the model "
                             f"(targets {list(spec.targets)})")
    if not expected:
        raise IntegrityError(f"no linear layer of the model matches the package's LoRA targets {list(spec.targets)}")


def merge(package: ModelPackage) -> ModelPackage:
    """The package with every adapter folded into its linear, ``W <- W + (alpha / r) * B A``, in float64 then
    cast back; adapters and the ``lora`` key are dropped. A package without adapters is returned unchanged."""
    spec = spec_of(package)
    if spec is None:
        return package
    base, adapters = split(package)
    tensors = dict(base.tensors)
    for a_name in (n for n in adapters if n.endswith(A_SUFFIX)):
        linear = a_name[: -len(A_SUFFIX)]
        weight_name = linear + ".weight"
        b_name = linear + B_SUFFIX
        if weight_name not in tensors or b_name not in adapters:
            raise IntegrityError(f"LoRA adapter {a_name} has no {weight_name} or {b_name} to merge with")
        weight = tensors[weight_name]
        delta = spec.scaling * (adapters[b_name].astype(np.float64) @ adapters[a_name].astype(np.float64))
        tensors[weight_name] = (weight.astype(np.float64) + delta).astype(weight.dtype)
    return _with_meta(package, tensors, base.meta)


def trainable_patterns(head: Sequence[str] = (r"classifier\..*",)) -> list[str]:
    """Trainable-tensor patterns for a LoRA task: every adapter, plus the task head (``head`` patterns)."""
    return [r".*\.lora_[AB]", *head]


def _hook(linear, inputs, output):
    """``y + (alpha / r) x A^T B^T`` (the adapted linear's forward)."""
    (x,) = inputs
    return output + (x @ linear.lora_A.t() @ linear.lora_B.t()) * getattr(linear, SCALING_ATTR)


def _kaiming_uniform_(tensor: Any, generator: Any) -> None:
    """``nn.init.kaiming_uniform_(tensor, a=sqrt(5))`` (nn.Linear's weight init) drawn from ``generator``."""
    fan_in = tensor.shape[1]
    bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))
    tensor.uniform_(-bound, bound, generator=generator)


def _with_meta(package: ModelPackage, tensors: dict[str, np.ndarray], meta: Mapping[str, Any]) -> ModelPackage:
    files = dict(package.files)
    files[META_FILE] = meta_bytes(meta)
    return ModelPackage(tensors=tensors, files=files)
