"""Error feedback: what a lossy codec did not send is kept and added to the next round's delta.

Math, per tensor, with ``C`` the codec, ``x_t`` the round-t delta and ``r_0 = 0``::

    y_t     = fl32(x_t + r_t)              what is encoded this round
    s_t     = decode(C(y_t))               what the aggregator receives
    r_{t+1} = fl32(y_t - s_t)              what was not sent

Summed over rounds the residual telescopes: ``sum_t s_t + r_T = sum_t x_t + e``, where ``e`` is only the
float32 rounding of the two updates above. Per coordinate::

    |sum_{t<T} s_t + r_T - sum_{t<T} x_t| <= 2^-24 sum_{t<T} (|y_t| + |r_{t+1}|) + 2T * 2^-150

(round to nearest: ``|fl(a) - a| <= 2^-24 |fl(a)|`` plus ``2^-150`` for subnormals). With top-k and fp32
values the residual update itself is exact: ``r_{t+1} + s_t == y_t`` bit for bit (each coordinate was either
sent whole or kept whole). So nothing is lost, only delayed: the residual carries exactly what was not sent.

Two-phase use, so that a crash never loses or double-counts a residual::

    ef = ErrorFeedback.load(path, codec) if path.exists() else ErrorFeedback(codec)
    enc = ef.encode(name, delta, rng=rng)      # stages r_{t+1}; the committed r_t is unchanged
    ef.save(path)                               # durable: committed and staged residuals
    ... upload enc, get the aggregator's ack ...
    ef.commit(); ef.save(path)                  # r_{t+1} becomes current

After a restart with staged residuals (``ef.pending``): if the update is resent and acknowledged,
``commit()``; if it is abandoned, ``discard()``. Encoding a tensor again before ``commit`` restarts from the
committed residual (a retried round).

Persistence: one safetensors file (no pickle, nothing executable), written to a temporary file in the same
folder with mode 0600, fsync'd and renamed over the old file (``os.replace``), then the folder is fsync'd:
the file on disk is always either the old or the new state. Residuals are derived from patient data;
keep them on the site.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import numpy.typing as npt
import safetensors.numpy

from fedclinic.codecs.base import Codec, Encoded, as_finite_f32
from fedclinic.codecs.errors import CodecInputError, IntegrityError
from fedclinic.codecs.spec import parse_codec
from fedclinic.runtime.durable_file import write_atomically
from fedclinic.runtime.safetensors_file import safetensors_with_metadata

FORMAT = "fedclinic-error-feedback/1"
_COMMITTED, _PENDING = "committed/", "pending/"


class ErrorFeedback:
    """Per-tensor residuals of a lossy codec (see the module docstring for the math and the protocol)."""

    def __init__(self, codec: Codec | str) -> None:
        self.codec: Codec = parse_codec(codec) if isinstance(codec, str) else codec
        self._residual: dict[str, npt.NDArray[np.float32]] = {}
        self._pending: dict[str, npt.NDArray[np.float32]] = {}

    # --------------------------------------------------------------------------------------------- rounds

    def encode(self, name: str, x: npt.ArrayLike, *, rng: np.random.Generator | None = None) -> Encoded:
        """Encode ``x + r`` (``r`` = the committed residual of ``name``, zero at first) and stage the new
        residual ``(x + r) - decode(sent)``. Raises :class:`CodecInputError` if ``x`` is not finite float32
        or its shape differs from the residual's (the model changed: :meth:`reset` the tensor)."""
        arr = as_finite_f32(x, self.codec.spec)
        r = self._residual.get(name)
        if r is not None and r.shape != arr.shape:
            raise CodecInputError(f"error feedback: tensor {name!r} has shape {arr.shape} but its residual has "
                                  f"shape {r.shape}; the model changed: call reset({name!r}) to drop the residual")
        flat = arr.reshape(-1)  # 1-D throughout: 0-d arithmetic would give numpy scalars
        y = flat + r.reshape(-1) if r is not None else flat.copy()
        if not np.isfinite(y).all():
            raise CodecInputError(f"error feedback: delta + residual of {name!r} overflows float32; the delta is "
                                  f"far too large (training diverged)")
        enc = self.codec.encode(y.reshape(arr.shape), rng=rng)
        y -= self.codec.decode(enc.payload, enc.params).reshape(-1)
        self._pending[name] = y.reshape(arr.shape)
        return enc

    def with_residual(self, name: str, x: npt.ArrayLike) -> npt.NDArray[np.float32]:
        """``x + r`` (``r`` = the committed residual of ``name``; ``x`` itself when there is none or the shape
        changed, the model changed: that residual is dropped) as float32: what a sparsifier outside this class
        (secure aggregation's shared index set) selects from; stage what it did not send with :meth:`stage`."""
        arr = as_finite_f32(x, self.codec.spec)
        r = self._residual.get(name)
        if r is not None and r.shape != arr.shape:
            self.reset(name)
            r = None
        y = arr + r if r is not None else arr.copy()
        if not np.isfinite(y).all():
            raise CodecInputError(f"error feedback: delta + residual of {name!r} overflows float32; the delta is "
                                  f"far too large (training diverged)")
        return y

    def stage(self, name: str, unsent: npt.ArrayLike) -> None:
        """Stage ``unsent`` (float32, finite) as the next residual of ``name``: what a sparsifier outside this class
        did not send of :meth:`with_residual`'s value. Committed or discarded like :meth:`encode`'s."""
        self._pending[name] = as_finite_f32(unsent, self.codec.spec).copy()

    def commit(self) -> None:
        """Make the staged residuals current (after the aggregator acknowledged the update)."""
        self._residual.update(self._pending)
        self._pending.clear()

    def discard(self) -> None:
        """Drop the staged residuals (the update was never delivered; the committed ones stay)."""
        self._pending.clear()

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of one tensor (or all): what was not sent is dropped."""
        if name is None:
            self._residual.clear()
            self._pending.clear()
        else:
            self._residual.pop(name, None)
            self._pending.pop(name, None)

    @property
    def names(self) -> tuple[str, ...]:
        """Tensors with a committed residual."""
        return tuple(sorted(self._residual))

    @property
    def pending(self) -> tuple[str, ...]:
        """Tensors with a staged (not yet committed) residual."""
        return tuple(sorted(self._pending))

    def residual(self, name: str) -> npt.NDArray[np.float32] | None:
        """A copy of the committed residual of ``name`` (None if there is none)."""
        r = self._residual.get(name)
        return None if r is None else r.copy()

    # ------------------------------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write committed and staged residuals to ``path`` atomically (safetensors, mode 0600, fsync'd)."""
        path = Path(path)
        tensors = {_COMMITTED + k: np.require(v, requirements=["C"]) for k, v in self._residual.items()}
        tensors.update({_PENDING + k: np.require(v, requirements=["C"]) for k, v in self._pending.items()})
        meta = {"format": FORMAT, "codec": self.codec.spec}
        write_atomically(path, safetensors.numpy.save(tensors, metadata=meta), mode=0o600)

    @classmethod
    def load(cls, path: str | os.PathLike[str], codec: Codec | str | None = None) -> ErrorFeedback:
        """Read residuals saved by :meth:`save`. ``codec`` defaults to the one saved; another codec is
        allowed (a residual is just what was not sent). :class:`IntegrityError` if the file is not a valid
        error-feedback state; ``FileNotFoundError`` if it does not exist."""
        path = Path(path)
        data = path.read_bytes()
        what = (f"error-feedback state {str(path)!r} is unreadable ({{}}); restore it from backup, or delete it to "
                f"restart with zero residuals (what was not yet sent is then lost)")
        try:
            tensors, meta = safetensors_with_metadata(data)
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise IntegrityError(what.format(f"{type(e).__name__}: {e}")) from None
        if meta.get("format") != FORMAT:
            raise IntegrityError(what.format(f"format {meta.get('format')!r}, expected {FORMAT!r}"))
        ef = cls(codec if codec is not None else meta.get("codec", ""))
        for key, arr in tensors.items():
            if arr.dtype != np.float32 or not np.isfinite(arr).all():
                raise IntegrityError(what.format(f"tensor {key!r} is {arr.dtype} or not finite"))
            if key.startswith(_COMMITTED):
                ef._residual[key[len(_COMMITTED):]] = arr
            elif key.startswith(_PENDING):
                ef._pending[key[len(_PENDING):]] = arr
            else:
                raise IntegrityError(what.format(f"unexpected tensor {key!r}"))
        return ef
