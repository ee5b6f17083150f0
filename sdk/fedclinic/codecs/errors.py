"""Errors of the codec library, as subclasses of :mod:`fedclinic.errors` so callers can catch either.

- :class:`CodecSpecError` (a :class:`~fedclinic.errors.ConfigError`): a codec spec string names an unknown
  codec or parameter, or a parameter value is out of range. Raised when a task or agent is configured.
- :class:`CodecInputError` (a :class:`~fedclinic.errors.FedclinicError` and :class:`ValueError`): the tensor
  handed to ``encode`` cannot be encoded (not float32, NaN/Inf, outside the codec's range), or ``decode_into``
  got an unusable accumulator. A caller's mistake; nothing was sent.
- :class:`~fedclinic.errors.IntegrityError`: a received payload or its params are malformed (wrong length,
  bad params, out-of-range indices, non-finite values). Raised before anything is written to an accumulator.
"""

from __future__ import annotations

from fedclinic.errors import ConfigError, FedclinicError, IntegrityError

__all__ = ["CodecInputError", "CodecSpecError", "IntegrityError"]


class CodecSpecError(ConfigError):
    """A codec spec string or codec parameter is invalid (the message names the codec and the parameter)."""


class CodecInputError(FedclinicError, ValueError):
    """A tensor cannot be encoded with the chosen codec, or an accumulator does not fit the payload."""
