"""Which cached block leaves a pool when a block is needed, and whether a preempted sequence is swapped.

Eviction: when the device needs a block and none is free, the least recently
used cached block that has no child on the device goes (leaves before parents,
so the device's cached blocks always form whole prefixes). With the host tier
it is copied there, the host evicting its own least recently used leaf for
room; without, it is dropped.

Swapping: a preempted sequence's computed blocks past its prefix-cached ones go
to the host when copying them out and back costs less than recomputing them
(``Evictor.swap_pays``).

The block manager owns one ``Evictor``, which works on the pools, the prefix cache, the copy queue and
the counters the manager hands it at construction.
"""
from __future__ import annotations

from collections import Counter

from lmport.kv.allocator import BlockAllocator
from lmport.kv.host_tier import CopyQueue
from lmport.kv.prefix_cache import CachedBlock, PrefixCache
from lmport.sched.sequence import Sequence

# Bytes the host link moves in the time the device does one FLOP of prefill. A
# PCIe 4/5 link (25-50 GB/s) against the 50-100 TFLOP/s an accelerator reaches
# in prefill gives 2.5e-4 to 1e-3; a CPU backend's memcpy against its FLOP rate
# is far higher, so this errs towards recomputing there.
LINK_BYTES_PER_FLOP = 5e-4


class Evictor:
    """Eviction and the swap cost rule over a block manager's pools (``lmport.kv.block_manager``)."""

    def __init__(self, allocator: BlockAllocator, cache: PrefixCache | None, host: BlockAllocator | None,
                 copies: CopyQueue, stats: Counter[str], *, block_size: int, bytes_per_block: int,
                 flops_per_token: float, link_bytes_per_flop: float):
        self.allocator, self.cache, self.host, self.copies, self.stats = allocator, cache, host, copies, stats
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.flops_per_token = flops_per_token
        self.link_bytes_per_flop = link_bytes_per_flop

    def swap_pays(self, seq: Sequence, num_cached_blocks: int, num_blocks: int) -> bool:
        """The cost rule: swap when copying the blocks out and back costs less link time than
        recomputing their tokens costs device time, i.e. when

            2 * num_blocks * bytes_per_block  <  tokens * flops_per_token * LINK_BYTES_PER_FLOP

        with tokens = computed tokens past the prefix-cached blocks (those come back from the
        cache either way), and only when the host can take the blocks (evicting cached ones)."""
        if self.host.num_free + self.host.num_cached < num_blocks:
            return False
        tokens = seq.num_computed - num_cached_blocks * self.block_size
        return 2 * num_blocks * self.bytes_per_block < tokens * self.flops_per_token * self.link_bytes_per_flop

    def evict_device(self) -> None:
        block = self._victim(self.allocator, self.cache.device, on_host=False)
        e = self.cache.device[block]
        slot = self._host_slot() if self.host is not None else None
        if slot is None:
            self.cache.drop(e)
        else:
            self.copies.add(block, slot, to_host=True)
            self.cache.move(e, slot, on_host=True)
        self.allocator.evict(block)
        self.stats["device_evictions"] += 1

    def evict_host(self) -> None:
        block = self._victim(self.host, self.cache.host, on_host=True)
        self.cache.drop(self.cache.host[block])
        self.host.evict(block)
        self.stats["host_evictions"] += 1

    def _host_slot(self) -> int | None:
        """A host block for an entry leaving the device (None when every host block is swapped-out KV)."""
        if self.host.num_free == 0 and self.host.num_cached == 0:
            return None
        if self.host.num_free == 0:
            self.evict_host()
        (slot,) = self.host.allocate(1)
        self.host.decref(slot, keep=True)
        return slot

    def host_allocate(self, n: int) -> list[int]:
        while self.host.num_free < n:
            self.evict_host()
        return self.host.allocate(n)

    def _victim(self, allocator: BlockAllocator, entries: dict[int, CachedBlock], *, on_host: bool) -> int:
        """Least recently used cached block with no child in its pool (on the host: no child at all)."""
        first = None
        for block in allocator.lru():
            children = entries[block].children
            if (not children) if on_host else all(c.on_host for c in children):
                return block
            first = block if first is None else first
        # Unreachable while every holder of a block also holds its parent; kept so eviction cannot fail.
        self.stats["lru_fallbacks"] += 1
        if first is None:
            raise RuntimeError("no cached block to evict (callers evict only while cached blocks remain)")
        return first
