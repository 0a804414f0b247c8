"""Loaded weights backed by huge pages (lmport.weights.residency.back_with_huge_pages)."""
import sys

import pytest
import torch

from lmport.weights.residency import _huge_page_size, back_with_huge_pages


def huge_bytes_under(t: torch.Tensor) -> int:
    """Bytes of transparent huge pages in the mappings that overlap ``t`` (/proc/self/smaps)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_COLLAPSE) is Linux's")
def test_weights_move_to_huge_pages_with_their_contents():
    size = _huge_page_size()
    weight = torch.arange(4 * size // 4, dtype=torch.float32)   # four huge pages' worth, faulted in as small pages
    before = weight.clone()
    if huge_bytes_under(weight) >= 3 * size:
        pytest.skip("this system backs anonymous memory with huge pages already (THP 'always')")
    back_with_huge_pages([weight])
    if huge_bytes_under(weight) == 0:
        pytest.skip("this kernel does not collapse pages on request (MADV_COLLAPSE needs Linux 6.1)")
    assert huge_bytes_under(weight) >= 3 * size   # every huge page wholly inside the tensor
    assert torch.equal(weight, before)


def test_tensors_off_the_host_are_left_alone():
    back_with_huge_pages([torch.empty(0), torch.ones(3, device="meta")])
