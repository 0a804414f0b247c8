"""Reference-counted block allocator over one pool (device or host).

Every block is in exactly one state:
- free:   no reference, no contents worth keeping;
- used:   referenced (ref count > 0) by sequences (or, on the host, by a swapped-out sequence);
- cached: no reference, but its contents are a prefix-cache block, kept until evicted.
Invariant: free + used + cached = total. Cached blocks are kept in the order
they were released (oldest first), which is the LRU order eviction follows.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def allocate(self, n: int = 1) -> list[int]:
        """free -> used. Making room by evicting cached blocks is the caller's job."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def take(self, block: int) -> None:
        """cached -> used: a prefix-cache hit on a block nobody held."""
        del self._cached[block]
        self.ref_counts[block] = 1

    def incref(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is not in use; take() it instead")
        self.ref_counts[block] += 1

    def decref(self, block: int, *, keep: bool = False) -> bool:
        """Drop one reference; True when it was the last. The block then becomes
        cached (most recently used) when ``keep``, free otherwise."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is not in use")
        self.ref_counts[block] -= 1
        if self.ref_counts[block]:
            return False
        if keep:
            self._cached[block] = None
        else:
            self._free.append(block)
        return True

    def evict(self, block: int) -> None:
        """cached -> free."""
        del self._cached[block]
        self._free.append(block)

    def lru(self) -> Iterator[int]:
        """Cached blocks, least recently used first."""
        return iter(self._cached)

    def check_invariants(self) -> None:
        free, cached = set(self._free), set(self._cached)
        used = {b for b, c in enumerate(self.ref_counts) if c > 0}
        if min(self.ref_counts) < 0:
            raise AssertionError("allocator broken: negative reference count")
        if len(free) != len(self._free):
            raise AssertionError("allocator broken: free list has duplicates")
        if free & cached or (free | cached) & used:
            raise AssertionError("allocator broken: a block is in two states")
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise AssertionError(f"allocator broken: free {len(free)} + cached {len(cached)} + used {len(used)} "
                                 f"!= {self.num_blocks}")
