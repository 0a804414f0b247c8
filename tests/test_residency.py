"""Pages under weights handed back once copied (lmport.weights.residency.page_out): a mapped file's to the page
cache, so that the next load of the file reads memory; any other memory's contents kept."""
import ctypes
import gc
import mmap
import os
import sys
import warnings

import numpy as np
import pytest
import torch

from lmport.weights import residency
from support.smaps import mapped_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and mincore as Linux has them")
FILE_BYTES = 256 * mmap.PAGESIZE


def cached_pages(path) -> int:
    """Pages of the file at ``path`` in the OS's page cache (mincore over a mapping of it of our own)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pages = (ctypes.c_ubyte * (-(-len(m) // mmap.PAGESIZE)))()
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        assert ctypes.CDLL(None).mincore(ctypes.c_void_p(base), ctypes.c_size_t(len(m)), pages) == 0
        return sum(p & 1 for p in pages)


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(FILE_BYTES))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # read in through the mapping, as a load's
    return path


def test_pages_of_a_mapped_file_leave_the_process_and_stay_cached(weights_file):
    blob = residency.map_file(weights_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # torch's warning on a non-writable array
        weights = torch.from_numpy(blob[mmap.PAGESIZE:])   # a tensor's view, as a checkpoint's tensors are
    copy = weights.clone()   # what a load keeps
    assert mapped_bytes(weights, "Rss:") >= FILE_BYTES - mmap.PAGESIZE
    residency.page_out([weights])
    assert mapped_bytes(weights, "Rss:") <= mmap.PAGESIZE   # the process holds what it copied, not the file's pages
    assert cached_pages(weights_file) >= FILE_BYTES // mmap.PAGESIZE - 1   # the next load finds them in memory
    assert torch.equal(weights, copy)   # read again, faulted back in


def test_other_memory_keeps_its_contents():
    """Memory not of a file map_file mapped (a torch allocation, an anonymous mapping) is only reclaimed:
    advice that drops the pages (an anonymous page comes back zero) is never given to it."""
    region = mmap.mmap(-1, FILE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    values = torch.frombuffer(region, dtype=torch.float32)
    values.copy_(torch.arange(values.numel(), dtype=torch.float32))
    owned = torch.arange(FILE_BYTES // 4, dtype=torch.float32)
    residency.page_out([values, owned])
    assert torch.equal(values, torch.arange(values.numel(), dtype=torch.float32))
    assert torch.equal(owned, torch.arange(FILE_BYTES // 4, dtype=torch.float32))
    del values
    region.close()


def test_a_file_is_forgotten_once_unmapped(weights_file):
    blob = residency.map_file(weights_file)
    start = blob.ctypes.data
    assert start in residency._mapped_files
    del blob
    gc.collect()
    assert start not in residency._mapped_files
