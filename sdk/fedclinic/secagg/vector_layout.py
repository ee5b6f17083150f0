"""What one secure-aggregation input holds beyond the delta: weights, per-tensor counts, evaluation metrics.

A site's input is one vector over the session's ring Z_{2^r} (``Quantizer.ring_bits``), laid out as::

    [ w * q(delta)  (P values, the tensors in the session's order)          ]
    [ w_m * qm(metric) for each metric name                   (k values)    ]
    [ w or 0 for each count slot: one per tensor (per_tensor_counts, SAFL) or one for all   ]
    [ w or 0 for each metric (0 when this site has no finite value for it)  (k values)    ]

``q`` is the delta's :class:`~fedclinic.secagg.Quantizer` (``[-clip, clip]``, ``bits``), ``qm`` the metrics'
(``[-metric_clip, metric_clip]``, ``metric_bits``: as many as the ring holds for the cohort, at most
:data:`METRIC_BITS`; :func:`metric_bits_for`), both with the same ring and weight cap. The delta decides the
ring (:func:`fedclinic.secagg.quantize.ring_for`), so a few metric slots never widen the whole vector. ``w`` is the
site's weight: its training-sample count capped at ``weight_cap`` (1 for uniform weights). A tensor the site
did not send (SAFL: a layer it did not select) is all zeros *and* its count slot is 0. Every slot is an
integer in ``[0, W * L]``, so the survivors' sum cannot wrap when ``Quantizer.check_cohort`` holds.

The sum reveals, per tensor ``t`` and metric ``m``: ``S_t = sum_i w_i q(x_i)``, ``W_t = sum_i w_i`` (over
the sites that sent ``t``) and the same for metrics, so :meth:`VectorLayout.decode` returns the weighted means
``S_t * step / W_t - clip`` -- exactly what plain sample-weighted FedAvg (per tensor, as SAFL's plain rounds
do) and the round's sample-weighted evaluation metrics compute, up to quantization:

    |decoded mean - sum_i w_i clip(x_i) / sum_i w_i| <= (rho + 2^-19) * step + 2^-24 * clip   (per value)

(``rho`` = 1/2 nearest, 1 stochastic: each site's rounding error is at most ``rho`` levels *before* it is
multiplied by ``w_i``, so the weighted mean's error is at most ``rho`` levels; :meth:`VectorLayout.error_bound`).
Nothing else about a site is revealed: its weight, sent layers and metrics are inside its masked input.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedclinic.secagg.encoding import DOMAIN, encode
from fedclinic.secagg.errors import SecAggConfigError, SecAggInputError
from fedclinic.secagg.quantize import MAX_BITS, Quantizer

METRIC_BITS = MAX_BITS
"""Highest precision of the metric slots: 2^24 - 1 levels over ``[-metric_clip, metric_clip]``."""
MAX_METRICS = 32
"""Most metric names one session sums (each costs two slots)."""


@dataclass(frozen=True)
class Decoded:
    """The unmasked sum, decoded: weighted means of the tensors that any survivor sent, weighted means of the
    metrics that any survivor reported, and the total weights behind them."""

    tensors: dict[str, np.ndarray]        # name -> flat float32 weighted mean (absent: no survivor sent it)
    metrics: dict[str, float]             # name -> weighted mean (absent: no survivor reported it)
    tensor_weights: dict[str, int]        # name -> sum of the weights of the sites that sent it
    metric_weights: dict[str, int]


@dataclass(frozen=True)
class VectorLayout:
    """The slots of one session's inputs (see the module docstring); every member derives the same layout from
    the session's setup (tensor order and sizes, metric names, per-tensor counts, quantizers)."""

    tensors: tuple[tuple[str, int], ...]      # (name, number of values), in the session's order
    quantizer: Quantizer
    metric_names: tuple[str, ...] = ()
    metric_clip: float = 100.0
    per_tensor_counts: bool = False
    metric_bits: int = METRIC_BITS

    def __post_init__(self) -> None:
        if len(self.metric_names) > MAX_METRICS or len(set(self.metric_names)) != len(self.metric_names):
            raise SecAggConfigError(f"a session sums at most {MAX_METRICS} distinct metric names")
        if not (math.isfinite(self.metric_clip) and self.metric_clip > 0):
            raise SecAggConfigError(f"metric_clip must be a finite positive number, got {self.metric_clip!r}")
        if any(n < 0 for _, n in self.tensors):
            raise SecAggConfigError("tensor sizes must be non-negative")
        if self.metric_names:
            self.metric_quantizer  # noqa: B018 -- refuses a ring too narrow for the metric slots

    def digest(self) -> bytes:
        """SHA-256 over everything that places a value in the vector (tensors and sizes, quantizers, ring, weight
        cap, metric names, clip and bits, per-tensor counts): part of the session id, so every member encodes
        with the same layout or the session's masks do not cancel."""
        q = self.quantizer
        parts = encode(DOMAIN, "layout", len(self.tensors), *(x for t in self.tensors for x in t), q.clip, q.bits,
                       q.rounding, q.ring_bits, q.weight_cap, len(self.metric_names), *self.metric_names,
                       self.metric_clip, self.metric_bits, int(self.per_tensor_counts))
        return hashlib.sha256(parts).digest()

    @property
    def metric_quantizer(self) -> Quantizer:
        """The metrics' quantizer: ``[-metric_clip, metric_clip]``, ``metric_bits``, same rounding, ring and
        weight cap."""
        q = self.quantizer
        return Quantizer(clip=self.metric_clip, bits=self.metric_bits, rounding=q.rounding, ring_bits=q.ring_bits,
                         weight_cap=q.weight_cap)

    @property
    def levels(self) -> int:
        """The largest unweighted slot value (the wider of the two quantizers' ``L``)."""
        return self.metric_quantizer.levels if self.metric_names else self.quantizer.levels

    @property
    def values(self) -> int:
        """``P``: the delta's values."""
        return sum(n for _, n in self.tensors)

    @property
    def count_slots(self) -> int:
        return len(self.tensors) if self.per_tensor_counts else 1

    @property
    def length(self) -> int:
        """The vector length: ``P + 2k + count slots``."""
        return self.values + 2 * len(self.metric_names) + self.count_slots

    def check_cohort(self, n: int) -> None:
        """Refuse a cohort of ``n`` whose sums of any slot could wrap the ring (SecAggConfigError)."""
        self.quantizer.check_cohort(n)
        if self.metric_names:
            self.metric_quantizer.check_cohort(n)

    def weight_of(self, num_samples: int) -> int:
        """A site's integer weight: its sample count, at least 1, at most ``weight_cap``."""
        return max(1, min(int(num_samples), self.quantizer.weight_cap))

    def encode(self, delta: Mapping[str, np.ndarray], *, weight: int, metrics: Mapping[str, float] | None = None,
               seed: bytes | None = None) -> np.ndarray:
        """One site's input in the ring: ``delta`` holds the tensors it sends (flat or shaped, any subset of the
        layout's when ``per_tensor_counts``, else all of them), ``weight`` its integer weight (see
        :meth:`weight_of`), ``metrics`` its evaluation figures (names outside the layout are refused; missing or
        non-finite ones get count 0). ``seed`` fixes stochastic rounding (tests)."""
        q, dt = self.quantizer, self.quantizer.dtype
        if not (isinstance(weight, int) and 1 <= weight <= q.weight_cap):
            raise SecAggInputError(f"weight must be an integer in [1, {q.weight_cap}], got {weight!r}")
        unknown = sorted(set(delta) - {n for n, _ in self.tensors})
        if unknown:
            raise SecAggInputError(f"tensors outside the session's layout: {unknown[:3]}")
        if not self.per_tensor_counts and len(delta) != len(self.tensors):
            raise SecAggInputError("every site of this session sends every tensor (no per-tensor counts)")
        out = np.zeros(self.length, dtype=dt)
        w = dt.type(weight)
        offset, counts = 0, self.values + len(self.metric_names)
        for i, (name, size) in enumerate(self.tensors):
            value = delta.get(name)
            if value is not None:
                flat = np.asarray(value, dtype=np.float32).ravel()
                if flat.size != size:
                    raise SecAggInputError(f"tensor {name!r} has {flat.size} values; the session expects {size}")
                part = out[offset:offset + size]
                part[...] = q.quantize(flat, seed=seed)
                part *= w
                if self.per_tensor_counts:
                    out[counts + i] = w
            offset += size
        if not self.per_tensor_counts:
            out[counts] = w
        self._encode_metrics(out, metrics or {}, w, seed)
        return out

    def _encode_metrics(self, out: np.ndarray, metrics: Mapping[str, float], w: np.generic, seed: bytes | None) -> None:
        k = len(self.metric_names)
        if not k:
            return
        unknown = sorted(set(metrics) - set(self.metric_names))
        if unknown:
            raise SecAggInputError(f"metrics outside the session's layout: {unknown[:3]}")
        values = np.zeros(k, dtype=np.float64)
        have = np.zeros(k, dtype=bool)
        for j, name in enumerate(self.metric_names):
            v = metrics.get(name)
            if v is not None and math.isfinite(float(v)):
                values[j], have[j] = float(v), True
        base, counts = self.values, self.values + k + self.count_slots
        slots = self.metric_quantizer.quantize(values, seed=seed).astype(out.dtype) * w
        out[base:base + k] = np.where(have, slots, 0)
        out[counts:counts + k] = np.where(have, w, 0)

    def decode(self, total: np.ndarray) -> Decoded:
        """The weighted means from the survivors' unmasked ring sum (see the module docstring)."""
        q = self.quantizer
        if not isinstance(total, np.ndarray) or total.dtype != q.dtype or total.shape != (self.length,):
            raise SecAggInputError(f"the sum must be a {q.dtype} vector of {self.length} values")
        k = len(self.metric_names)
        counts = self.values + k
        tensors: dict[str, np.ndarray] = {}
        weights: dict[str, int] = {}
        offset = 0
        for i, (name, size) in enumerate(self.tensors):
            wt = int(total[counts + (i if self.per_tensor_counts else 0)])
            if wt:
                s = total[offset:offset + size].astype(np.float64)
                s *= q.step / wt
                s -= q.clip
                tensors[name], weights[name] = s.astype(np.float32), wt
            offset += size
        metrics: dict[str, float] = {}
        metric_weights: dict[str, int] = {}
        mcounts = counts + self.count_slots
        for j, name in enumerate(self.metric_names):
            qm = self.metric_quantizer
            wm = int(total[mcounts + j])
            if wm:
                metrics[name] = float(total[self.values + j]) * qm.step / wm - qm.clip
                metric_weights[name] = wm
        return Decoded(tensors, metrics, weights, metric_weights)

    def error_bound(self) -> float:
        """Per-value bound on ``|decoded mean - weighted mean of the clipped inputs|`` (module docstring)."""
        q = self.quantizer
        rho = 0.5 if q.rounding == "nearest" else 1.0
        return (rho + 2.0 ** -19) * q.step + 2.0 ** -24 * q.clip

    def metric_error_bound(self) -> float:
        """The same bound for the metrics' weighted means."""
        qm = self.metric_quantizer
        rho = 0.5 if qm.rounding == "nearest" else 1.0
        return (rho + 2.0 ** -19) * qm.step


def tensor_sizes(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[tuple[str, int], ...]:
    """``(name, number of values)`` pairs for a layout."""
    return tuple((n, int(np.prod(s, dtype=np.int64))) for n, s in zip(names, shapes))


def metric_bits_for(quantizer: Quantizer, cohort: int) -> int:
    """The metric slots' precision for a session: the most bits (at most :data:`METRIC_BITS`, at least the delta's)
    whose weighted sums over ``cohort`` sites fit the delta's ring."""
    room = quantizer.ring_max // (cohort * quantizer.weight_cap)
    return max(quantizer.bits, min(METRIC_BITS, room.bit_length() - (0 if room == (1 << room.bit_length()) - 1 else 1)))
