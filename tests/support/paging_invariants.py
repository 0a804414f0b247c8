"""The block manager's accounting, checked after every step of the tests' workloads: the pools, the
prefix-cache index, the swapped-out blocks, and ref counts against the block tables holding them
(the invariants are listed in lmport.kv.block_manager)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lmport.kv.block_manager import BlockManager
from lmport.sched.sequence import Sequence


def check_block_manager(bm: BlockManager, seqs: Iterable[Sequence] | None = None) -> None:
    """Pool accounting, the cache index, and (given every live sequence) ref count = holders."""
    bm.allocator.check_invariants()
    cached = set(bm.allocator.lru())
    if bm.cache is None:
        if cached:
            raise AssertionError("cached blocks without a prefix cache")
    else:
        bm.cache.check_invariants()
        if not cached <= bm.cache.device.keys():
            raise AssertionError("a cached device block has no prefix-cache entry")
        if any(bm.allocator.ref_counts[b] == 0 and b not in cached for b in bm.cache.device):
            raise AssertionError("a prefix-cache entry points at a free device block")
    if bm.host is not None:
        bm.host.check_invariants()
        host_cached = set(bm.host.lru())
        if bm.cache is not None and host_cached != bm.cache.host.keys():
            raise AssertionError("host cached blocks and host prefix-cache entries disagree")
        swapped = [b for s in bm.swapped.values() for b in s.host_blocks]
        if sorted(swapped) != sorted(b for b, c in enumerate(bm.host.ref_counts) if c > 0) or \
                any(bm.host.ref_counts[b] != 1 for b in swapped):
            raise AssertionError("used host blocks are not exactly the swapped-out blocks")
    if seqs is not None:
        holders = Counter(b for s in seqs for b in s.block_table)
        if any(bm.allocator.ref_counts[b] != holders[b] for b in range(bm.allocator.num_blocks)):
            raise AssertionError("a device block's ref count differs from the tables holding it")
