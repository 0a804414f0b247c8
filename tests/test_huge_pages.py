"""Loaded weights backed by huge pages (lmport.weights.residency.back_with_huge_pages)."""
import ctypes
import mmap
import sys

import pytest
import torch

from lmport.weights.residency import MADV_COLLAPSE, _huge_page_size, back_with_huge_pages
from support.smaps import mapped_bytes


def fresh_pages(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """float32 zeros on private pages mapped for them alone (none a huge page yet, whatever the heap holds)."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return region, torch.frombuffer(region, dtype=torch.float32)


def kernel_collapses(size: int) -> bool:
    """Whether this kernel collapses pages on request (MADV_COLLAPSE, Linux 6.1+) and does not back
    anonymous memory with huge pages by itself (THP 'always')."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[always]" in f.read():
                return False
    except OSError:
        return False
    region, probe = fresh_pages(3 * size)
    probe.fill_(1.0)
    start = -(-probe.data_ptr() // size) * size
    taken = ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), MADV_COLLAPSE) == 0
    del probe
    region.close()
    return taken


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_COLLAPSE) is Linux's")
def test_weights_move_to_huge_pages_with_their_contents():
    size = _huge_page_size()
    if not kernel_collapses(size):
        pytest.skip("this kernel does not collapse pages on request (MADV_COLLAPSE needs Linux 6.1), "
                    "or backs anonymous memory with huge pages by itself (THP 'always')")
    region, weight = fresh_pages(5 * size)   # four whole huge pages at least, faulted in as small pages
    weight.copy_(torch.arange(weight.numel(), dtype=torch.float32))
    before, huge_before = weight.clone(), mapped_bytes(weight, "AnonHugePages:")
    back_with_huge_pages([weight])
    # (a kernel short of free huge pages may collapse fewer)
    assert mapped_bytes(weight, "AnonHugePages:") >= huge_before + size
    assert torch.equal(weight, before)
    del weight
    region.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is only called on Linux")
def test_tensors_off_the_host_are_left_alone(monkeypatch):
    """No madvise for a tensor with no host memory under it (a meta tensor's data_ptr is 0: advising there would
    name pages that are not its), while a host tensor's pages are advised."""
    from lmport.weights import residency
    calls = []

    class Libc:   # records madvise(start, length, advice) instead of asking the OS
        def madvise(self, start, length, advice):
            calls.append((start.value, length.value, advice))
            return 0

    monkeypatch.setattr(residency.ctypes, "CDLL", lambda *args, **kwargs: Libc())
    back_with_huge_pages([torch.empty(0), torch.ones(3, device="meta")])
    assert calls == []
    host = torch.ones(1 << 20)
    back_with_huge_pages([host])
    assert calls and all(advice == MADV_COLLAPSE for _, _, advice in calls)
    start, length, _ = calls[0]
    assert start <= host.data_ptr() and host.data_ptr() + 4 * host.numel() <= start + length
