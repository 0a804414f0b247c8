"""Paging of memory-mapped checkpoints: read ahead before a load, handed back once copied.

Weights copied out of a memory-mapped checkpoint (a GGUF's Q4_1 blocks split into codes and scales,
projections merged into one linear) leave the pages they were copied from resident: the file's other
tensors keep the mapping alive. Paging those out keeps a process's memory at the weights it uses.
A load reads every tensor: asking the OS up front to read the whole range (``MADV_WILLNEED``) turns a
cold file's page faults, one readahead window at a time, into one sequential read the load overlaps.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_WILLNEED = 3
MADV_PAGEOUT = 21   # Linux 5.4+ (asm-generic/mman-common.h); Python's mmap module may not name it


def read_ahead(tensor: torch.Tensor) -> None:
    """Ask the OS to start reading the pages under a host tensor (a mapped file's) in the background."""
    _advise([tensor], MADV_WILLNEED, outer=True)


def page_out(tensors: list[torch.Tensor]) -> None:
    """Ask the OS to reclaim the whole pages under these host tensors (Linux ``MADV_PAGEOUT``, which
    keeps their contents: a later read faults them back in)."""
    _advise(tensors, MADV_PAGEOUT, outer=False)


def _advise(tensors: list[torch.Tensor], advice: int, outer: bool) -> None:
    """madvise over each host tensor's pages: those it touches (``outer``) or only those it fills whole."""
    if not sys.platform.startswith("linux"):
        return
    libc, page = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu":
            continue
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        start = first // page * page if outer else -(-first // page) * page
        end = -(-last // page) * page if outer else last // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)   # a hint: errors ignored
