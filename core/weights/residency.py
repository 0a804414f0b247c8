"""Handing pages of host tensors back to the OS once their contents live elsewhere.

Weights copied out of a memory-mapped checkpoint (a GGUF's Q4_1 blocks split into codes and scales,
projections merged into one linear) leave the pages they were copied from resident: the file's other
tensors keep the mapping alive. Paging those out keeps a process's memory at the weights it uses.
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

MADV_PAGEOUT = 21   # Linux 5.4+ (asm-generic/mman-common.h); Python's mmap module may not name it


def page_out(tensors: list[torch.Tensor]) -> None:
    """Ask the OS to reclaim the whole pages under these host tensors (Linux ``MADV_PAGEOUT``, which
    keeps their contents: a later read faults them back in)."""
    if not sys.platform.startswith("linux"):
        return
    libc, page = ctypes.CDLL(None, use_errno=True), mmap.PAGESIZE
    for t in tensors:
        if t.device.type != "cpu":
            continue
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_PAGEOUT)   # a hint: errors ignored
