"""Keep a long-running service's heap from holding on to the model-sized traffic it has passed through.

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a mapping of its own that
``free`` returns to the kernel at once. But the threshold is *dynamic*: each time such a block is freed the
threshold rises to its size (up to 32 MiB), so after the first 2 MiB tensor chunk every later one comes from
the heap arenas, and chunks allocated on gRPC's threads and freed on a writer thread leave the arenas
fragmented: a service that streamed a 400 MB model kept ~400 MB of freed heap resident (measured in
docs/results/large-model.md). :func:`fix_mmap_threshold` pins the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``
also turns the dynamic adjustment off), so chunk-sized buffers are mapped and unmapped and the resident set
stays bounded by what is live. Other C libraries are left alone.

The hospital agent does not pin the threshold (its training steps would map and fault every tensor-sized
buffer: issue 19's overhead bench ran 1.45x slower); it calls :func:`release_free_heap` once a stream has passed
through it instead (``malloc_trim(0)``: the whole free pages inside every arena's free chunks go back to the
kernel), so the chunks a model fetch left as fragmented heap do not stay in its resident set for the round (about
0.09x of a 4.4 GB model on a 16-core machine: docs/results/large-model.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "release_free_heap"]

#: blocks at least this large are mapped (and returned to the kernel when freed); glibc's own start value
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def _glibc() -> "ctypes.CDLL | None":
    """The C library when it is glibc (whose mallopt numbering and malloc_trim this module uses), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 -- present only in glibc
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def release_free_heap() -> bool:
    """Give the heap's free memory back to the kernel (glibc ``malloc_trim(0)``, every arena); True when glibc
    released some, False when there was none to release or the C library is not glibc. Live allocations are not
    touched; it costs a walk over the free chunks (milliseconds), so call it after a large transfer, not per chunk."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc.malloc_trim(0) == 1


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes for this process; True when applied, False where the
    C library is not glibc (nothing changes there)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
