"""Mask expansion: a 32-byte key -> a vector of uniform words in Z_{2^32}, added or subtracted in place.

Definition (the contract every client and the server share)::

    PRG(key)[i] = uint32_le( AES-256-CTR(key, initial counter block 0^128)[4i : 4i+4] )

AES-256 in counter mode is a pseudorandom function of the full-entropy 32-byte key, so the words are
computationally indistinguishable from independent uniform values in Z_{2^32}; since the modulus is a
power of two, no rejection sampling is needed (a 32-bit word *is* a uniform residue). Each key is
derived per session and per pair (see :mod:`fedclinic.secagg.keys`) and expands exactly one vector, so a
keystream is never reused and the all-zero counter block is safe (Google's ``AesCtrPrng`` makes the same
choice). The counter is 128 bits wide; the session caps vectors at 2^34 words (2^36 bytes), far below
any AES-CTR limit.

Speed: the keystream is produced by OpenSSL (AES-NI/VAES) into one reusable chunk buffer that numpy
views with ``frombuffer``; each chunk is folded into the target with one vectorised ``np.add`` /
``np.subtract`` (wrapping mod 2^32). Chunks are processed for *all* keys before moving on, so the target
chunk stays in cache while every mask is applied. No per-element Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from fedclinic.secagg.keys import KEY_BYTES

CHUNK_WORDS = 1 << 16
"""Words per chunk (256 KiB of keystream): measured fastest on the 2-core bench machine."""

MAX_WORDS = 1 << 34
"""Longest vector a single mask key may expand (2^36 bytes of keystream)."""


def apply_masks(target: np.ndarray, *, add: Sequence[bytes] = (), subtract: Sequence[bytes] = (),
                chunk_words: int = CHUNK_WORDS) -> None:
    """In place: ``target += sum(PRG(k) for k in add) - sum(PRG(k) for k in subtract)  (mod 2^32)``.

    ``target`` must be a writeable, C-contiguous 1-D ``uint32`` array of at most :data:`MAX_WORDS`.
    Single-threaded: ``cryptography`` holds the GIL while it encrypts (measured), so Python threads
    would not overlap the keystream work.
    """
    if not isinstance(target, np.ndarray) or target.dtype != np.uint32 or target.ndim != 1:
        raise TypeError("masks apply to a 1-D numpy uint32 vector")
    if not target.flags.c_contiguous or not target.flags.writeable:
        raise ValueError("the masked vector must be C-contiguous and writeable")
    if target.size > MAX_WORDS:
        raise ValueError(f"vector of {target.size} words exceeds the per-key limit of {MAX_WORDS}")
    if chunk_words < 1:
        raise ValueError("chunk_words must be positive")
    streams = [(_encryptor(k), np.add) for k in add] + [(_encryptor(k), np.subtract) for k in subtract]
    n = target.size
    if not streams or n == 0:
        return
    chunk = min(chunk_words, n)
    zeros = memoryview(bytes(4 * chunk))
    buf = bytearray(4 * chunk + 16)  # update_into needs block_size - 1 spare bytes
    words = np.frombuffer(buf, dtype="<u4", count=chunk)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        part, ks, src = target[start:start + m], words[:m], zeros[:4 * m]
        for enc, op in streams:
            enc.update_into(src, buf)
            op(part, ks, out=part)


def _encryptor(key: bytes) -> CipherContext:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a mask key is {KEY_BYTES} bytes")
    return Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()


def expand_mask(key: bytes, length: int) -> np.ndarray:
    """``PRG(key)[:length]`` as a new ``uint32`` vector (for tests and reference; production code folds
    masks in place with :func:`apply_masks`)."""
    if length < 0:
        raise ValueError("length must be non-negative")
    out = np.zeros(length, dtype=np.uint32)
    apply_masks(out, add=[key])
    return out
