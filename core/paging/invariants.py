"""The block manager's accounting, checked: pools, the prefix-cache index, swapped blocks, ref counts.

See the invariants in ``lmport.paging.block_manager``; tests run the check after every step.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lmport.paging.allocator import BlockAllocator
from lmport.paging.prefix_cache import PrefixCache
from lmport.sequence import Sequence

if TYPE_CHECKING:
    from lmport.paging.block_manager import _Swap


class Invariants:
    """``check_invariants()`` of ``lmport.paging.block_manager.BlockManager``."""

    # State of the BlockManager this is mixed into.
    allocator: BlockAllocator
    cache: PrefixCache | None
    host: BlockAllocator | None
    _swapped: dict[Sequence, _Swap]

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Pool accounting, the cache index, and (given every live sequence) ref count = holders."""
        self.allocator.check_invariants()
        cached = set(self.allocator.lru())
        if self.cache is None:
            if cached:
                raise AssertionError("cached blocks without a prefix cache")
        else:
            self.cache.check_invariants()
            if not cached <= self.cache.device.keys():
                raise AssertionError("a cached device block has no prefix-cache entry")
            if any(self.allocator.ref_counts[b] == 0 and b not in cached for b in self.cache.device):
                raise AssertionError("a prefix-cache entry points at a free device block")
        if self.host is not None:
            self.host.check_invariants()
            host_cached = set(self.host.lru())
            if self.cache is not None and host_cached != self.cache.host.keys():
                raise AssertionError("host cached blocks and host prefix-cache entries disagree")
            swapped = [b for s in self._swapped.values() for b in s.host_blocks]
            if sorted(swapped) != sorted(b for b, c in enumerate(self.host.ref_counts) if c > 0) or \
                    any(self.host.ref_counts[b] != 1 for b in swapped):
                raise AssertionError("used host blocks are not exactly the swapped-out blocks")
        if seqs is not None:
            holders = Counter(b for s in seqs for b in s.block_table)
            if any(self.allocator.ref_counts[b] != holders[b] for b in range(self.allocator.num_blocks)):
                raise AssertionError("a device block's ref count differs from the tables holding it")
