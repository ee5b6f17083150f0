"""Keep a long-running service's heap from holding on to the model-sized traffic it has passed through.

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a mapping of its own that
``free`` returns to the kernel at once. But the threshold is *dynamic*: each time such a block is freed the
threshold rises to its size (up to 32 MiB), so after the first 2 MiB tensor chunk every later one comes from
the heap arenas, and chunks allocated on gRPC's threads and freed on a writer thread leave the arenas
fragmented: a service that streamed a model kept about as much freed heap resident (measured in
docs/results/large-model.md). :func:`fix_mmap_threshold` pins the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``
also turns the dynamic adjustment off), so chunk-sized buffers are mapped and unmapped and the resident set
stays bounded by what is live. Other C libraries are left alone.

The hospital agent does not pin the threshold for good (at 128 KiB its training steps would map and fault every
tensor-sized buffer: issue 19's overhead bench ran 1.45x slower). It pins it only while a model is fetched
(:func:`mapped_while_streaming`), so the fetch's 2 MiB chunks are mapped and unmapped instead of being left as
free heap that grows with the model and that ``malloc_trim`` did not give back (docs/results/large-model.md),
and then leaves it at 32 MiB with a 64 MiB trim threshold: where glibc's
dynamic threshold itself ends up once blocks that large have been freed, so training allocates from the heap as
before. (``mallopt`` cannot turn the dynamic adjustment back on.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from typing import Iterator

__all__ = ["AFTER_STREAM_THRESHOLD_BYTES", "MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "mapped_while_streaming"]

#: blocks at least this large are mapped (and returned to the kernel when freed); glibc's own start value
MMAP_THRESHOLD_BYTES = 128 * 1024
#: the threshold left after a stream: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, the dynamic threshold's ceiling
AFTER_STREAM_THRESHOLD_BYTES = 32 << 20
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_TRIM_THRESHOLD = -1


def _glibc() -> "ctypes.CDLL | None":
    """The C library when it is glibc (whose mallopt numbering and malloc_trim this module uses), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 -- present only in glibc
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def _mallopt(option: int, value: int) -> bool:
    """glibc's ``mallopt(option, value)``; True when applied, False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt(option, int(value)) == 1


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes for this process; True when applied, False where the
    C library is not glibc (nothing changes there)."""
    return _mallopt(_M_MMAP_THRESHOLD, threshold)


@contextlib.contextmanager
def mapped_while_streaming() -> Iterator[bool]:
    """Inside: the mmap threshold pinned at :data:`MMAP_THRESHOLD_BYTES` (as :func:`fix_mmap_threshold`), so the
    chunk-sized buffers of a stream are mapped and unmapped. On exit, whatever happened inside: the threshold at
    :data:`AFTER_STREAM_THRESHOLD_BYTES` and the trim threshold at twice that, the values glibc's dynamic
    adjustment reaches once such blocks have been freed. Yields whether it applied (False where the C library is
    not glibc: nothing changes there). Process-wide, like every ``mallopt``."""
    applied = fix_mmap_threshold()
    try:
        yield applied
    finally:
        if applied:
            fix_mmap_threshold(AFTER_STREAM_THRESHOLD_BYTES)
            _mallopt(_M_TRIM_THRESHOLD, 2 * AFTER_STREAM_THRESHOLD_BYTES)
