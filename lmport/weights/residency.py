"""Paging of weights: a memory-mapped checkpoint read ahead before a load and handed back once copied,
the loaded weights backed with huge pages.

Weights copied out of a memory-mapped checkpoint (a GGUF's Q4_1 blocks split into codes and scales,
projections merged into one linear) leave the pages they were copied from resident: the file's other
tensors keep the mapping alive. Paging those out keeps a process's memory at the weights it uses. Pages of a
file this module mapped (``map_file``) are only let go by the process (``MADV_DONTNEED``): the OS keeps them
in its page cache, so that the next load of the file (a server restarted) reads memory, not the disk. Others
are reclaimed (``MADV_PAGEOUT``): advice that may drop their contents would be wrong for memory whose owner is
not known.
A load reads every tensor: asking the OS up front to read the whole range (``MADV_WILLNEED``) turns a
cold file's page faults, one readahead window at a time, into one sequential read the load overlaps.
"""
from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from pathlib import Path

import numpy as np
import torch

MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_PAGEOUT = 21   # Linux 5.4+ (asm-generic/mman-common.h); Python's mmap module may not name it
MADV_COLLAPSE = 25   # Linux 6.1+: back a range with transparent huge pages now, whatever the THP setting


# The address ranges of the files map_file mapped (start: end), each while its mapping lives.
_mapped_files: dict[int, int] = {}


def map_file(path: str | Path) -> np.memmap:
    """``path`` mapped read-only, the whole file."""
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    start = blob.ctypes.data
    _mapped_files[start] = start + blob.nbytes
    weakref.finalize(blob._mmap, _mapped_files.pop, start, None)   # unmapped with its last view
    return blob


def read_ahead(tensor: torch.Tensor) -> None:
    """Ask the OS to start reading the pages under a host tensor (a mapped file's) in the background."""
    _advise([tensor], MADV_WILLNEED, outer=True)


def page_out(tensors: list[torch.Tensor]) -> None:
    """Hand back the whole pages under these host tensors, their contents kept (a later read faults them back
    in): a mapped file's to the page cache, others to be reclaimed."""
    in_file = [_in_mapped_file(t) for t in tensors]
    _advise([t for t, mapped in zip(tensors, in_file) if mapped], MADV_DONTNEED, outer=False)
    _advise([t for t, mapped in zip(tensors, in_file) if not mapped], MADV_PAGEOUT, outer=False)


def _in_mapped_file(t: torch.Tensor) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return t.device.type == "cpu" and any(first <= start and end <= last for first, last in _mapped_files.items())


def _advise(tensors: list[torch.Tensor], advice: int, outer: bool, page: int = mmap.PAGESIZE) -> bool:
    """madvise over each host tensor's pages: those it touches (``outer``) or only those it fills whole.
    A hint: whether the OS took every call."""
    if not sys.platform.startswith("linux"):
        return False
    libc, taken = ctypes.CDLL(None, use_errno=True), True
    for t in tensors:
        if t.device.type != "cpu":
            continue
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        start = first // page * page if outer else -(-first // page) * page
        end = -(-last // page) * page if outer else last // page * page
        if end > start:
            taken &= libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0
    return taken


def back_with_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Ask the OS to back the memory under these host tensors with huge pages (Linux ``MADV_COLLAPSE``,
    which keeps their contents). A decode step reads every weight once: in 4 KiB pages that is a TLB miss,
    a page walk (two levels of tables deep under a hypervisor), every 4 KiB; in 2 MiB pages almost none.
    A tensor gets the huge pages that cover it, which may hold its neighbours too (harmless), or where
    those reach past its mapping (a large tensor is mapped on its own), the ones it fills whole."""
    page = _huge_page_size()
    for t in tensors:
        if not _advise([t], MADV_COLLAPSE, outer=True, page=page):
            _advise([t], MADV_COLLAPSE, outer=False, page=page)


def _huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20
