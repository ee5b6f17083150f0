"""The codec interface, the payload reader behind streaming decode, and the checks every codec shares.

A codec turns a float32 tensor ``x`` (a weight delta) into ``Encoded(payload, params)``: ``payload`` is
bytes, ``params`` a small JSON-able dict that makes the payload self-describing (``params["codec"]`` names
the decoder, ``params["shape"]`` the tensor's shape, the rest is codec-specific). Decoding needs nothing
else: :func:`decode` and :func:`decode_into` dispatch on ``params["codec"]``.

Decoding goes through a reader that first validates the whole payload (lengths, params, index ranges,
finiteness) and then yields ``(where, values)`` pairs of at most one chunk each: ``where`` is a slice of the
flat tensor (dense codecs) or an array of strictly increasing flat indices (sparsifiers), ``values`` a fresh
float32 array. :func:`decode` scatters them into a zero tensor; :func:`decode_into` adds
``weight * values`` straight into the caller's accumulator, so no dense temporary larger than one chunk is
ever made, and a malformed payload raises :class:`~fedclinic.errors.IntegrityError` before the accumulator
is touched. Both use the very same values, so ``decode_into(acc, ...)`` leaves exactly
``acc + weight * decode(...)`` (same float operations in the same order, bit for bit).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from fedclinic.codecs.errors import CodecInputError, IntegrityError

DEFAULT_CHUNK = 1 << 16
"""Elements decoded per step by default (256 KiB of float32: stays in L2)."""

MAX_ELEMENTS = (1 << 32) - 1
"""Largest tensor (elements) a codec accepts: flat indices travel as uint32."""

Buffer = bytes | bytearray | memoryview
Params = dict[str, Any]
Selection = slice | npt.NDArray[np.int64]


@dataclass(frozen=True)
class Encoded:
    """An encoded tensor: ``payload`` bytes plus JSON-able ``params`` (``codec``, ``shape``, codec fields)."""

    payload: bytes
    params: Params

    @property
    def nbytes(self) -> int:
        """Length of the payload in bytes (params not included; see :mod:`fedclinic.codecs.accounting`)."""
        return len(self.payload)


class Reader(ABC):
    """A view of one payload whose lengths and params were checked. ``validate`` checks the content
    (per chunk, without writing anything); ``chunks`` yields ``(where, float32 values)`` of at most ``step``
    values each."""

    n: int
    step: int

    @abstractmethod
    def validate(self) -> None:
        """Check everything that is not checked on construction (per-chunk content); raise IntegrityError."""

    @abstractmethod
    def chunks(self) -> Iterator[tuple[Selection, npt.NDArray[np.float32]]]:
        """Decoded values in chunks, each with its position in the flat tensor."""


class DenseReader(Reader):
    """A reader whose payload holds every element; ``values`` decodes any range starting on a step."""

    @abstractmethod
    def values(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        """Fresh float32 array of decoded elements ``start..stop-1`` (``start`` a multiple of ``step``)."""

    def chunks(self) -> Iterator[tuple[Selection, npt.NDArray[np.float32]]]:
        for a in range(0, self.n, self.step):
            b = min(self.n, a + self.step)
            yield slice(a, b), self.values(a, b)


class Codec(ABC):
    """An update-payload codec. Subclasses are frozen dataclasses whose fields are the spec parameters.

    ``name`` is the codec id used in spec strings, in ``params["codec"]`` and at ``Hello`` negotiation;
    ``kind`` is ``"value"`` (encodes every element) or ``"sparsifier"`` (selects elements, then encodes the
    kept values with a value codec); ``bound`` states the per-element error bound in words (the method
    :meth:`error_bound` computes it).
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["value", "sparsifier"]]
    bound: ClassVar[str]

    @property
    def needs_rng(self) -> bool:
        """Whether :meth:`encode` needs a Generator (stochastic rounding)."""
        return False

    @property
    @abstractmethod
    def spec(self) -> str:
        """Canonical spec string; ``parse_codec(c.spec) == c``."""

    @abstractmethod
    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        """Payload and codec-specific params of a finite, 1-D float32 array."""

    @classmethod
    @abstractmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> Reader:
        """A reader of ``buf`` (the payload as uint8) for a tensor of ``n`` elements; checks lengths/params."""

    @classmethod
    @abstractmethod
    def _param_keys(cls) -> frozenset[str]:
        """Codec-specific keys of ``params`` (besides ``codec`` and ``shape``)."""

    @abstractmethod
    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        """Per-element error bound for a finite flat input (float64 math)."""

    def encode(self, x: npt.ArrayLike, *, rng: np.random.Generator | None = None) -> Encoded:
        """Encode a finite float32 tensor. ``rng`` (a seeded ``np.random.Generator``) is required by codecs
        with stochastic rounding and ignored by the others; the same generator state gives the same bytes.

        Raises :class:`CodecInputError` for a non-float32 or non-finite input or one outside the codec's
        range (the message says which element and what to use instead)."""
        arr = as_finite_f32(x, self.spec)
        if self.needs_rng and not isinstance(rng, np.random.Generator):
            raise CodecInputError(f"codec {self.spec!r} rounds stochastically and needs a seeded numpy Generator: "
                                  f"encode(x, rng=np.random.default_rng(seed)), or use rounding=nearest")
        payload, extra = self._encode_flat(arr.reshape(-1), rng)
        return Encoded(payload, {"codec": self.name, "shape": [int(d) for d in arr.shape], **extra})

    def decode(self, payload: Buffer, params: Mapping[str, Any]) -> npt.NDArray[np.float32]:
        """Decode a payload this codec produced (``params["codec"]`` must be this codec's name)."""
        self._check_name(params)
        return decode(payload, params)

    def decode_into(self, acc: npt.NDArray[np.floating[Any]], payload: Buffer, params: Mapping[str, Any],
                    weight: float = 1.0, *, chunk: int = DEFAULT_CHUNK) -> None:
        """``acc += weight * decode(payload, params)``, streamed; see :func:`decode_into`."""
        self._check_name(params)
        decode_into(acc, payload, params, weight, chunk=chunk)

    def _check_name(self, params: Mapping[str, Any]) -> None:
        got = params.get("codec") if isinstance(params, Mapping) else None
        if got != self.name:
            raise IntegrityError(f"payload is encoded with codec {got!r}, expected {self.name!r}")

    def error_bound(self, x: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Per-element bound ``b`` with ``|decode(encode(x)) - x| <= b`` (float64, shape of ``x``), for every
        ``rng``. See the codec's docstring for the formula."""
        arr = as_finite_f32(x, self.spec)
        return self._bound_flat(arr.reshape(-1).astype(np.float64)).reshape(arr.shape)

    def __str__(self) -> str:
        return self.spec


# ---------------------------------------------------------------------------------------------------- registry

_CODECS: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` decodable by name and parseable in spec strings."""
    if cls.name in _CODECS:
        raise RuntimeError(f"codec {cls.name!r} registered twice")
    _CODECS[cls.name] = cls
    return cls


def registered() -> Mapping[str, type[Codec]]:
    """Codec classes by name, in registration order."""
    return dict(_CODECS)


# -------------------------------------------------------------------------------------------- shared checks

def as_finite_f32(x: npt.ArrayLike, codec: str) -> npt.NDArray[np.float32]:
    """``x`` as a float32 ndarray, refusing other dtypes and NaN/Inf with a message naming the element."""
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise CodecInputError(f"codec {codec!r} encodes float32 deltas; got dtype {arr.dtype} "
                              f"(convert with x.astype(np.float32) after checking the range)")
    if arr.size > MAX_ELEMENTS:
        raise CodecInputError(f"codec {codec!r}: tensor has {arr.size} elements, at most {MAX_ELEMENTS} are "
                              f"supported; split the tensor")
    finite = np.isfinite(arr)
    if not finite.all():
        bad = np.flatnonzero(~finite.reshape(-1))
        raise CodecInputError(f"codec {codec!r}: delta has {bad.size} non-finite value(s) (NaN/Inf), first "
                              f"{arr.reshape(-1)[bad[0]]} at flat index {int(bad[0])}; the local training "
                              f"diverged: fix it (lower the learning rate, clip gradients) before sending")
    return arr


def as_buffer(payload: Buffer) -> npt.NDArray[np.uint8]:
    """The payload as a read-only uint8 array (no copy)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise IntegrityError(f"payload must be bytes, got {type(payload).__name__}")
    return np.frombuffer(payload, dtype=np.uint8)


def param_int(params: Mapping[str, Any], key: str, codec: str, lo: int, hi: int) -> int:
    """``params[key]`` as an int in ``[lo, hi]`` (bools refused), else IntegrityError."""
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise IntegrityError(f"{codec} payload: params[{key!r}] must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def param_str(params: Mapping[str, Any], key: str, codec: str, choices: Sequence[str]) -> str:
    """``params[key]`` as one of ``choices``, else IntegrityError."""
    v = params.get(key)
    if not isinstance(v, str) or v not in choices:
        raise IntegrityError(f"{codec} payload: params[{key!r}] must be one of {list(choices)}, got {v!r}")
    return v


def param_shape(params: Mapping[str, Any], codec: str) -> tuple[tuple[int, ...], int]:
    """``params["shape"]`` checked (list of non-negative ints), and its element count."""
    shape = params.get("shape")
    if not isinstance(shape, (list, tuple)) or len(shape) > 32 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise IntegrityError(f"{codec} payload: params['shape'] must be a list of non-negative integers, "
                             f"got {shape!r}")
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise IntegrityError(f"{codec} payload: shape {list(shape)} has {n} elements, more than {MAX_ELEMENTS}")
    return tuple(int(d) for d in shape), n


def check_length(buf: npt.NDArray[np.uint8], expected: int, codec: str, what: str) -> None:
    """IntegrityError unless the payload is exactly ``expected`` bytes."""
    if buf.size != expected:
        raise IntegrityError(f"{codec} payload is {buf.size} bytes, expected {expected} for {what}; the payload "
                             f"was truncated or corrupted in transit (resend it)")


def open_unvalidated(payload: Buffer, params: Mapping[str, Any], *, chunk: int = DEFAULT_CHUNK) -> Reader:
    """A reader of a payload whose params (known codec, exactly the expected keys, types) and lengths are
    checked; the per-chunk content checks are left to ``reader.validate()`` (composite codecs validate
    their parts once). Prefer :func:`open_payload`."""
    if not isinstance(params, Mapping):
        raise IntegrityError(f"codec params must be a JSON object, got {type(params).__name__}")
    name = params.get("codec")
    cls = _CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise IntegrityError(f"payload codec {name!r} is unknown to this version (known: {sorted(_CODECS)}); "
                             f"negotiate codecs at Hello")
    keys = cls._param_keys()
    extra = set(params) - {"codec", "shape"} - keys
    missing = keys - set(params)
    if extra or missing:
        raise IntegrityError(f"{name} payload params: unexpected keys {sorted(extra)}, missing keys "
                             f"{sorted(missing)} (expected {', '.join(['codec', 'shape', *sorted(keys)])})")
    _, n = param_shape(params, name)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise CodecInputError(f"chunk must be a positive number of elements, got {chunk!r}")
    return cls._reader(as_buffer(payload), params, n, chunk)


def open_payload(payload: Buffer, params: Mapping[str, Any], *, chunk: int = DEFAULT_CHUNK) -> Reader:
    """A fully validated reader of a payload (params, lengths and content, e.g. index ranges and
    finiteness). Raises :class:`IntegrityError` saying what is wrong."""
    reader = open_unvalidated(payload, params, chunk=chunk)
    reader.validate()
    return reader


def decode(payload: Buffer, params: Mapping[str, Any]) -> npt.NDArray[np.float32]:
    """Decode any registered codec's payload into a new float32 array of shape ``params["shape"]``."""
    reader = open_payload(payload, params)
    shape, _ = param_shape(params, str(params["codec"]))
    out = np.zeros(reader.n, dtype=np.float32)
    for where, vals in reader.chunks():
        out[where] = vals
    return out.reshape(shape)


def decode_into(acc: npt.NDArray[np.floating[Any]], payload: Buffer, params: Mapping[str, Any],
                weight: float = 1.0, *, chunk: int = DEFAULT_CHUNK) -> None:
    """Streaming decode-accumulate: ``acc += weight * decode(payload, params)``, chunk by chunk.

    ``acc`` is the flat (1-D) float32 or float64 accumulator of this tensor, ``acc.size == prod(shape)``.
    Dense codecs dequantize one chunk (about ``chunk`` elements, whole blocks) at a time and add it to
    ``acc[a:b]``; sparsifiers scatter-add one chunk of (index, value) pairs into ``acc``. Memory beyond the
    payload: a few chunk-sized temporaries. The payload is validated completely before the first write,
    so on :class:`IntegrityError` ``acc`` is unchanged. Result, bit for bit:
    ``acc + acc.dtype.type(weight) * decode(payload, params).astype(acc.dtype)``.
    """
    if not isinstance(acc, np.ndarray) or acc.ndim != 1 or acc.dtype not in (np.float32, np.float64):
        raise CodecInputError(f"accumulator must be a 1-D float32 or float64 numpy array, got "
                              f"{getattr(acc, 'dtype', type(acc).__name__)} with shape {getattr(acc, 'shape', None)}")
    if not acc.flags.writeable:
        raise CodecInputError("accumulator is read-only")
    w = acc.dtype.type(weight)
    if not np.isfinite(w):
        raise CodecInputError(f"weight must be finite in {acc.dtype}, got {weight!r}")
    reader = open_payload(payload, params, chunk=chunk)
    if acc.size != reader.n:
        raise CodecInputError(f"accumulator has {acc.size} elements, the payload's tensor has {reader.n} "
                              f"(shape {params.get('shape')}); pass the accumulator of the same tensor")
    for where, vals in reader.chunks():
        v = vals if acc.dtype == np.float32 else vals.astype(acc.dtype)
        if w != 1:
            v *= w  # w * x == x exactly when w == 1
        if isinstance(where, slice):
            target = acc[where]
            np.add(target, v, out=target)
        else:
            acc[where] += v  # indices are validated strictly increasing: no duplicates, no lost adds
