"""What /proc/self/smaps says of the memory under a tensor."""
from __future__ import annotations

import torch


def mapped_bytes(t: torch.Tensor, field: str) -> int:
    """The bytes ``field`` ("Rss:", "AnonHugePages:", ...) counts in the mappings that overlap ``t``."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == field:
                total += int(line.split()[1]) * 1024
    return total
