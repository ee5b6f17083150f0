"""Mask expansion: a 32-byte key -> a vector of uniform words in Z_{2^r}, added or subtracted in place.

Definition (the contract every client and the server share; ``b = r / 8`` bytes per word, r = 16, 32 or 64,
the session's ring width, :attr:`fedclinic.secagg.Quantizer.ring_bits`)::

    PRG_r(key)[i] = uint<r>_le( AES-256-CTR(key, initial counter block 0^128)[b*i : b*(i+1)] )

AES-256 in counter mode is a pseudorandom function of the full-entropy 32-byte key, so the words are
computationally indistinguishable from independent uniform values in Z_{2^32}; since the modulus is a
power of two, no rejection sampling is needed (a 32-bit word *is* a uniform residue). Each key is
derived per session and per pair (see :mod:`fedclinic.secagg.keys`) and expands exactly one vector, so a
keystream is never reused and the all-zero counter block is safe (Google's ``AesCtrPrng`` makes the same
choice). The counter is 128 bits wide; the session caps vectors at 2^34 words (2^36 bytes), far below
any AES-CTR limit.

Random access (shown for r = 32; a block holds ``16 / b`` words in general): words ``4j .. 4j+3`` are the AES
block with counter ``j`` (128-bit big-endian), so a
stream that starts at word ``4j`` is AES-256-CTR with initial counter block ``j``. The vector is cut into
such block-aligned pieces that are expanded independently, possibly on worker threads; the result is the
same words whatever the pieces.

Speed: the keystream is produced by OpenSSL (AES-NI/VAES) into a reusable chunk buffer that numpy views
with ``frombuffer``; each chunk is folded into the target with one vectorised ``np.add`` /
``np.subtract`` (wrapping mod 2^32). Chunks are processed for *all* keys before moving on, so the target
chunk stays in cache while every mask is applied, and an optional ``then`` callback consumes the finished
chunk while it is still in cache (the server dequantizes there, saving a pass over memory). No
per-element Python. Both ``cryptography`` (measured on the pinned 50.0.2: another thread runs at full speed
during a 400 MB ``update_into``) and numpy's loops release the GIL, so ``workers`` threads expand disjoint
pieces in parallel on as many cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from fedclinic.secagg.keys import KEY_BYTES

CHUNK_WORDS = 1 << 16
"""Words per chunk (256 KiB of keystream): measured fastest on the 2-core bench machine."""

MAX_WORDS = 1 << 34
"""Longest vector a single mask key may expand (2^36 bytes of keystream)."""

MASK_WORKERS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
"""Default threads for the server's unmasking pass: one per usable core, at most 8 (beyond that the adds
and the dequantization are bound by memory bandwidth, not by AES)."""

MIN_PIECE_WORDS = 1 << 18
"""Vectors shorter than two such pieces are expanded on the calling thread (threads cost more than they save)."""

PIECES_PER_WORKER = 4
"""With several workers the vector is cut into this many pieces per worker, so a worker that the OS
deschedules (the machine is shared) does not hold up the others for long."""

WORDS_PER_BLOCK = 4
"""uint32 words in one 16-byte AES block: pieces start at multiples of it (``16 // itemsize`` in general)."""

RING_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64))
"""The word types a mask may be folded into (the ring Z_{2^16}, Z_{2^32} or Z_{2^64})."""

_Op = Callable[..., object]


def apply_masks(target: np.ndarray, *, add: Sequence[bytes] = (), subtract: Sequence[bytes] = (),
                chunk_words: int = CHUNK_WORDS, workers: int = 1,
                then: Callable[[int, np.ndarray], object] | None = None) -> None:
    """In place: ``target += sum(PRG_r(k) for k in add) - sum(PRG_r(k) for k in subtract)  (mod 2^r)``.

    ``target`` must be a writeable, C-contiguous 1-D ``uint16``, ``uint32`` or ``uint64`` array (its dtype is the
    ring: r = 16, 32 or 64) of at most :data:`MAX_WORDS` words.
    ``then(start, part)``, if given, is called once for every chunk ``part = target[start:start+len(part)]``
    after all masks are applied to it (chunks are disjoint and cover ``target``); with ``workers > 1`` it is
    called from worker threads, concurrently for different chunks, and must only touch that range.
    ``workers`` (>= 1) threads share the vector; the result does not depend on it. An exception in a
    worker is re-raised here once the running pieces end (pieces not started yet are dropped); ``target``
    is then partly masked and must be discarded.
    """
    if not isinstance(target, np.ndarray) or target.dtype not in RING_DTYPES or target.ndim != 1:
        raise TypeError("masks apply to a 1-D numpy uint16, uint32 or uint64 vector")
    if not target.flags.c_contiguous or not target.flags.writeable:
        raise ValueError("the masked vector must be C-contiguous and writeable")
    if target.size > MAX_WORDS:
        raise ValueError(f"vector of {target.size} words exceeds the per-key limit of {MAX_WORDS}")
    if chunk_words < 1:
        raise ValueError("chunk_words must be positive")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError("workers must be a positive integer")
    for k in (*add, *subtract):
        _check_key(k)
    streams: list[tuple[bytes, _Op]] = [(k, np.add) for k in add] + [(k, np.subtract) for k in subtract]
    n = target.size
    if n == 0 or (not streams and then is None):
        return
    chunk = min(chunk_words, n)
    pieces = _pieces(n, workers, 16 // target.dtype.itemsize)
    if len(pieces) == 1:
        _apply_piece(target, streams, 0, n, chunk, then)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(pieces)), thread_name_prefix="secagg-masks") as pool:
        futures = [pool.submit(_apply_piece, target, streams, lo, hi, chunk, then) for lo, hi in pieces]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()


def _pieces(n: int, workers: int, per_block: int = WORDS_PER_BLOCK) -> list[tuple[int, int]]:
    """Block-aligned (``per_block`` words a block) ``[lo, hi)`` ranges covering ``range(n)``; one range unless
    threads pay off."""
    if workers == 1 or n < 2 * MIN_PIECE_WORDS:
        return [(0, n)]
    count = min(workers * PIECES_PER_WORKER, n // MIN_PIECE_WORDS)
    size = -(-n // count)
    size += -size % per_block
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _apply_piece(target: np.ndarray, streams: Sequence[tuple[bytes, _Op]], lo: int, hi: int, chunk: int,
                 then: Callable[[int, np.ndarray], object] | None) -> None:
    """Apply every stream to ``target[lo:hi]`` (``lo`` block-aligned), ``chunk`` words at a time."""
    size = target.dtype.itemsize
    encs = [(_encryptor(k, lo * size // 16), op) for k, op in streams]
    chunk = min(chunk, hi - lo)
    zeros = memoryview(bytes(size * chunk))
    buf = bytearray(size * chunk + 16)  # update_into needs block_size - 1 spare bytes
    words = np.frombuffer(buf, dtype=target.dtype.newbyteorder("<"), count=chunk)
    for start in range(lo, hi, chunk):
        m = min(chunk, hi - start)
        part, ks, src = target[start:start + m], words[:m], zeros[:size * m]
        for enc, op in encs:
            enc.update_into(src, buf)
            op(part, ks, out=part)
        if then is not None:
            then(start, part)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a mask key is {KEY_BYTES} bytes")


def _encryptor(key: bytes, first_block: int = 0) -> CipherContext:
    return Cipher(algorithms.AES(key), modes.CTR(first_block.to_bytes(16, "big"))).encryptor()


def expand_mask(key: bytes, length: int, dtype: np.dtype | type = np.uint32) -> np.ndarray:
    """``PRG_r(key)[:length]`` as a new vector of ``dtype`` (the ring; for tests and reference: production code
    folds masks in place with :func:`apply_masks`)."""
    if length < 0:
        raise ValueError("length must be non-negative")
    out = np.zeros(length, dtype=dtype)
    apply_masks(out, add=[key])
    return out
