"""glibc malloc settings for the cpu backend's step activations.

A prefill step allocates and frees tens of MB per op. glibc returns blocks that
large to the kernel on free (its mmap threshold and heap trimming adapt only
part of the way), so the next op faults in and zeroes fresh pages: about a
quarter of a 4096-token prefill. Keeping freed memory in the heap, as tcmalloc
or jemalloc do, removes that cost; the heap then holds about one step's peak.

Steps of different shapes leave that kept memory in holes between the blocks in use, which the heap grows
around: a server's process grows for thousands of requests while the memory it uses stays flat. When the
engine is idle (``give_back_freed_memory``) every whole free page goes back to the system.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling: larger blocks (the KV pools) are still mapped
TRIM_THRESHOLD = 512 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Sets glibc's thresholds once per process; False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("glibc malloc keeps freed step memory: %s", done)
    return done


def give_back_freed_memory() -> bool:
    """Returns to the system every whole page of memory glibc holds freed, in every arena (``malloc_trim``);
    False where the C library is not glibc or nothing was returned."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))
