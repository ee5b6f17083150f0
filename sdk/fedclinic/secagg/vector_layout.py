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

**Sparse sessions (a task's ``topk:F`` codec under secure aggregation).** With ``index_fraction = F`` the
delta part holds only the ``m = ceil(F * P)`` coordinates of a *shared random index set* (:meth:`VectorLayout.
index_set`), so the vector has ``m + 2k + count slots`` values. The set is drawn from ``index_seed``
(:func:`index_seed`: SHA-256 of the task, round, model hash and the session's nonce, so every member derives
the same set and each session a new one) with PCG64's raw output (stable across numpy versions): the ``m``
coordinates with the smallest 64-bit keys. The set is a function of public session parameters, never of any
site's data, so it reveals nothing about a site; the aggregator picks the nonce and could re-draw the set, which
changes nothing for privacy (every possible set is data-independent) and only which coordinates this round
moves. The digest covers ``F`` and a hash of the set.

:meth:`VectorLayout.decode` then gives the weighted mean on the set (same bound as above) and exact zeros
elsewhere. It does **not** rescale by ``1/F``: the sites keep what they did not send as an error-feedback
residual and add it to the next round's delta (``hospital_agent.secure_aggregation``), so every coordinate's
total is delivered eventually (random-k with memory); a ``1/F`` rescale would be unbiased only without that
memory and would multiply the quantization error (and the variance) by ``1/F``.

**Distributed DP (privacy level "distributed", :attr:`VectorLayout.dp`).** The update slots hold each site's
clipped, scaled, rounded update plus its Skellam noise share as signed integers in two's complement
(:mod:`fedclinic.secagg.skellam_encoding`); the layout is dense, uniformly weighted (one count slot of 1 per site)
and has no metric slots; :meth:`VectorLayout.decode` reads the sum as signed and divides by ``gamma m``. The
encoding's parameters are part of :meth:`VectorLayout.digest`.
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
from fedclinic.secagg.skellam_encoding import SkellamEncoding, UniformSource

METRIC_BITS = MAX_BITS
"""Highest precision of the metric slots: 2^24 - 1 levels over ``[-metric_clip, metric_clip]``."""
MAX_METRICS = 32
"""Most metric names one session sums (each costs two slots)."""
_INDEX_BLOCK = 1 << 20
"""Keys drawn per block when selecting an index set (bounds the temporary memory to ~16 MiB per block)."""


def index_seed(task_id: str, round_number: int, model_hash: bytes, nonce: bytes) -> bytes:
    """The seed of a sparse session's shared index set: SHA-256 over the task, round, model hash and the session's
    nonce (all in the setup every member checks against the session id)."""
    return hashlib.sha256(encode(DOMAIN, "index-set", task_id, round_number, model_hash, nonce)).digest()


def draw_index_set(seed: bytes, values: int, count: int) -> np.ndarray:
    """``count`` distinct coordinates of ``range(values)``, sorted (int64): those with the smallest keys of
    PCG64(seed)'s raw 64-bit stream (ties broken by position). Deterministic across platforms and numpy versions
    (the bit generator's stream is fixed; no ``Generator`` method is used)."""
    if not 0 <= count <= values:
        raise SecAggConfigError(f"an index set of {count} out of {values} values")
    if count == values:
        return np.arange(values, dtype=np.int64)
    gen = np.random.PCG64(int.from_bytes(hashlib.sha256(b"fedclinic-index-set/1" + seed).digest(), "little"))
    best_keys = np.empty(0, np.uint64)
    best_pos = np.empty(0, np.int64)
    for start in range(0, values, _INDEX_BLOCK):
        n = min(_INDEX_BLOCK, values - start)
        keys = np.concatenate([best_keys, gen.random_raw(n).astype(np.uint64)])
        pos = np.concatenate([best_pos, np.arange(start, start + n, dtype=np.int64)])
        best_keys, best_pos = smallest_pairs(keys, pos, count)
    return np.sort(best_pos)


def smallest_pairs(keys: np.ndarray, pos: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``count`` smallest ``(key, position)`` pairs (any order): ``np.partition`` finds the cut-off key only,
    and ties at it go to the smaller positions, so the result does not depend on how numpy partitions."""
    if keys.size <= count:
        return keys, pos
    cut = np.partition(keys, count - 1)[count - 1]
    below = np.flatnonzero(keys < cut)
    at = np.flatnonzero(keys == cut)
    at = at[np.argsort(pos[at], kind="stable")][:count - below.size]
    chosen = np.concatenate([below, at])
    return keys[chosen], pos[chosen]


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
    index_fraction: float = 0.0               # 0: dense; else only ceil(F * P) shared random coordinates are summed
    index_seed: bytes = b""                   # the index set's seed (:func:`index_seed`)
    #: distributed DP (privacy level "distributed"): the update slots hold clipped, scaled, rounded integers plus
    #: each site's Skellam noise share (:mod:`fedclinic.secagg.skellam_encoding`), uniform weights, dense, no metrics
    dp: SkellamEncoding | None = None

    def __post_init__(self) -> None:
        if self.dp is not None:
            q = self.quantizer
            if (self.per_tensor_counts or self.sparse or self.metric_names or q.weight_cap != 1
                    or self.dp.values != self.values or self.dp.ring_bits != q.ring_bits):
                raise SecAggConfigError("a distributed-DP layout is dense, uniformly weighted, without metrics or "
                                        "per-tensor counts, and its encoding covers the layout's values in its ring")
        if not (math.isfinite(self.index_fraction) and 0.0 <= self.index_fraction <= 1.0):
            raise SecAggConfigError(f"index_fraction must be in (0, 1] (0 = dense), got {self.index_fraction!r}")
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
        if self.dp is not None:
            parts += self.dp.digest_parts()
        if self.sparse:
            parts += encode("index-set", self.index_fraction, self.index_seed,
                            hashlib.sha256(self.index_set().astype("<i8").tobytes()).digest())
        return hashlib.sha256(parts).digest()

    @property
    def sparse(self) -> bool:
        """Whether only a shared random subset of the delta's coordinates is summed (``0 < index_fraction < 1``;
        a fraction of 1 keeps every coordinate and is the dense layout)."""
        return 0.0 < self.index_fraction < 1.0

    @property
    def sent_values(self) -> int:
        """``m``: the delta values in the vector (``ceil(F * P)`` when sparse, else ``P``)."""
        return min(self.values, math.ceil(self.index_fraction * self.values)) if self.sparse else self.values

    def index_set(self) -> np.ndarray:
        """The sorted coordinates of the flattened delta that this session sums (all of them when dense); the same
        for every member (a function of ``index_seed``, ``F`` and ``P`` only). Computed once per layout."""
        cached = self.__dict__.get("_index_set")
        if cached is None:
            cached = draw_index_set(self.index_seed, self.values, self.sent_values)
            cached.setflags(write=False)
            object.__setattr__(self, "_index_set", cached)
        return cached

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
        """The vector length: ``m + 2k + count slots`` (``m`` = :attr:`sent_values`)."""
        return self.sent_values + 2 * len(self.metric_names) + self.count_slots

    def check_cohort(self, n: int) -> None:
        """Refuse a cohort of ``n`` whose sums of any slot could wrap the ring (SecAggConfigError)."""
        self.quantizer.check_cohort(n)
        if self.dp is not None:
            self.dp.check_cohort(n)
        if self.metric_names:
            self.metric_quantizer.check_cohort(n)

    def weight_of(self, num_samples: int) -> int:
        """A site's integer weight: its sample count, at least 1, at most ``weight_cap``."""
        return max(1, min(int(num_samples), self.quantizer.weight_cap))

    def encode(self, delta: Mapping[str, np.ndarray], *, weight: int, metrics: Mapping[str, float] | None = None,
               seed: bytes | None = None, dp_noise: np.ndarray | None = None,
               dp_random: UniformSource | None = None) -> np.ndarray:
        """One site's input in the ring: ``delta`` holds the tensors it sends (flat or shaped, any subset of the
        layout's when ``per_tensor_counts``, else all of them), ``weight`` its integer weight (see
        :meth:`weight_of`), ``metrics`` its evaluation figures (names outside the layout are refused; missing or
        non-finite ones get count 0). ``seed`` fixes stochastic rounding (tests). Under distributed DP
        (:attr:`dp`) ``dp_noise`` is the site's int64 Skellam share per value and ``dp_random`` the rounding's
        uniform source (both required)."""
        if self.dp is not None:
            return self._encode_dp(delta, weight, dp_noise, dp_random)
        q, dt = self.quantizer, self.quantizer.dtype
        if not (isinstance(weight, int) and 1 <= weight <= q.weight_cap):
            raise SecAggInputError(f"weight must be an integer in [1, {q.weight_cap}], got {weight!r}")
        unknown = sorted(set(delta) - {n for n, _ in self.tensors})
        if unknown:
            raise SecAggInputError(f"tensors outside the session's layout: {unknown[:3]}")
        if not self.per_tensor_counts and len(delta) != len(self.tensors):
            raise SecAggInputError("every site of this session sends every tensor (no per-tensor counts)")
        out = np.zeros(self.values + self.length - self.sent_values, dtype=dt)  # dense; gathered at the end
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
        if self.sparse:
            return np.concatenate([out[self.index_set()], out[self.values:]])
        return out

    def _encode_dp(self, delta: Mapping[str, np.ndarray], weight: int, noise: np.ndarray | None,
                   rng: UniformSource | None) -> np.ndarray:
        assert self.dp is not None
        if weight != 1:
            raise SecAggInputError("distributed DP weights every site equally (weight 1)")
        if noise is None or rng is None:
            raise SecAggInputError("distributed DP needs the site's noise share and a uniform source")
        if set(delta) != {n for n, _ in self.tensors}:
            raise SecAggInputError("every site of a distributed-DP session sends every tensor")
        flat = np.concatenate([np.asarray(delta[name], dtype=np.float32).ravel() for name, _ in self.tensors])
        out = np.empty(self.length, dtype=self.quantizer.dtype)
        out[:self.values] = self.dp.encode(flat, noise, rng)
        out[self.values:] = 1  # the count slot: every site weighs 1
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
        keep = None
        if self.sparse:  # back to the dense slots; coordinates outside the index set decode to exact zeros below
            idx, m = self.index_set(), self.sent_values
            dense = np.zeros(self.values + self.length - m, dtype=total.dtype)
            dense[idx], dense[self.values:] = total[:m], total[m:]
            total, keep = dense, np.zeros(self.values, dtype=bool)
            keep[idx] = True
        tensors: dict[str, np.ndarray] = {}
        weights: dict[str, int] = {}
        offset = 0
        noisy = None
        if self.dp is not None and int(total[counts]):
            noisy = self.dp.decode(total[:self.values], int(total[counts]))
        for i, (name, size) in enumerate(self.tensors):
            wt = int(total[counts + (i if self.per_tensor_counts else 0)])
            if noisy is not None:
                tensors[name], weights[name] = noisy[offset:offset + size].astype(np.float32), wt
            elif wt:
                s = total[offset:offset + size].astype(np.float64)
                s *= q.step / wt
                s -= q.clip
                if keep is not None:
                    s[~keep[offset:offset + size]] = 0.0
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
        """Per-value bound on ``|decoded mean - weighted mean of the clipped inputs|`` (module docstring); under
        distributed DP the rounding's share only (below one step, ``1/gamma``), the noise comes on top."""
        if self.dp is not None:
            return 1.0 / self.dp.scale
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
