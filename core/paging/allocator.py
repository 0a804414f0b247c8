"""Reference-counted block allocator: free + used = total, always."""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def take(self, block: int) -> None:
        """Take a specific free block (a prefix-cache block coming back into use)."""
        self._free.remove(block)
        self.ref_counts[block] = 1

    def incref(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; take() it instead")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when the block became free."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)
            return True
        return False

    def check_invariants(self) -> None:
        used = sum(1 for c in self.ref_counts if c > 0)
        if used + len(self._free) != self.num_blocks or min(self.ref_counts) < 0:
            raise AssertionError(f"allocator broken: used {used} + free {len(self._free)} != {self.num_blocks}")
        if len(set(self._free)) != len(self._free) or any(self.ref_counts[b] for b in self._free):
            raise AssertionError("allocator broken: free list has duplicates or referenced blocks")
