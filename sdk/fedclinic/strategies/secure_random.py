"""A cryptographically secure source of random numbers for differential-privacy noise.

DP noise must be unpredictable to everyone who sees the noisy result: a noise stream that someone can replay
(a seeded Mersenne Twister, whose state is recoverable from 624 outputs) can be subtracted again. ``SecureRandom``
is the ChaCha20 stream cipher (RFC 8439, via ``cryptography``) keyed with 256 bits from the operating system
(``os.urandom``): its keystream is indistinguishable from uniform bytes without the key, the key never leaves the
object, and a fresh object is keyed afresh. This module turns the keystream into uniform numbers; the noise
distributions are built on top of it (Gaussian noise for DP-SGD and client-level DP, integer noise for distributed
DP) in their own modules. It lives with the strategies (torch-free, below every layer that draws DP noise: the
aggregator's client-level DP and the sites' DP-SGD) and is re-exported as :mod:`fedclinic.privacy.secure_random`.

Contract of the uniforms: :meth:`SecureRandom.uniform` gives float64 values ``k / 2^53`` for ``k`` uniform in
``[0, 2^53)`` (every double of that grid equally likely, so ``[0, 1)``); :meth:`SecureRandom.uniform_open` gives
``(k + 0.5) / 2^53`` (never 0 or 1, for logarithms). :meth:`SecureRandom.integers` gives uniform 64-bit words.
A test may pass ``key`` to replay a stream; every site path leaves it None.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

_MANTISSA = 53
_SCALE = 1.0 / float(1 << _MANTISSA)


class SecureRandom:
    """Uniform random bytes, words and floats from a ChaCha20 keystream keyed from ``os.urandom``."""

    def __init__(self, key: bytes | None = None) -> None:
        if key is None:
            key = os.urandom(32)
        if len(key) != 32:
            raise ValueError(f"a SecureRandom key is 32 bytes, got {len(key)}")
        # ChaCha20 in `cryptography` takes a 16-byte nonce (4-byte block counter + 12-byte nonce); the key is fresh
        # per object, so a zero nonce and counter never repeat a (key, nonce) pair
        self._stream = Cipher(algorithms.ChaCha20(key, b"\x00" * 16), mode=None).encryptor()

    def random_bytes(self, n: int) -> bytes:
        """The next ``n`` bytes of the keystream."""
        if n < 0:
            raise ValueError(f"cannot draw {n} bytes")
        return self._stream.update(bytes(n))

    def integers(self, shape: int | tuple[int, ...]) -> np.ndarray:
        """Uniform ``uint64`` words of the given shape."""
        count = int(np.prod(shape, dtype=np.int64)) if not isinstance(shape, int) else shape
        return np.frombuffer(self.random_bytes(8 * count), dtype="<u8").reshape(shape).astype(np.uint64, copy=False)

    def uniform(self, shape: int | tuple[int, ...]) -> np.ndarray:
        """Uniform float64 values on ``[0, 1)`` with 53 random bits each."""
        return (self.integers(shape) >> np.uint64(64 - _MANTISSA)).astype(np.float64) * _SCALE

    def uniform_open(self, shape: int | tuple[int, ...]) -> np.ndarray:
        """Uniform float64 values on ``(0, 1)``: the grid of :meth:`uniform` shifted by half a step."""
        return ((self.integers(shape) >> np.uint64(64 - _MANTISSA)).astype(np.float64) + 0.5) * _SCALE
