"""Keep a long-running service's heap from holding on to the model-sized traffic it has passed through.

glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a mapping of its own that
``free`` returns to the kernel at once. But the threshold is *dynamic*: each time such a block is freed the
threshold rises to its size (up to 32 MiB), so after the first 2 MiB tensor chunk every later one comes from
the heap arenas, and chunks allocated on gRPC's threads and freed on a writer thread leave the arenas
fragmented: a service that streamed a 400 MB model kept ~400 MB of freed heap resident (measured in
docs/results/large-model.md). :func:`fix_mmap_threshold` pins the threshold (``mallopt(M_MMAP_THRESHOLD, ...)``
also turns the dynamic adjustment off), so chunk-sized buffers are mapped and unmapped and the resident set
stays bounded by what is live. Other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold"]

#: blocks at least this large are mapped (and returned to the kernel when freed); glibc's own start value
MMAP_THRESHOLD_BYTES = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes for this process; True when applied, False where the
    C library is not glibc (nothing changes there)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 -- present only in glibc, whose mallopt numbering this uses
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
