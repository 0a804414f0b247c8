"""Per-sequence block tables over the device pool, with the prefix cache and the host tier.

Accounting (checked by ``check_invariants``), on each pool:
  device: free + used + cached = total
  host:   free + used + cached = total, used = blocks of swapped-out sequences
where used = referenced by a sequence (its ref count is the number of block
tables holding it), cached = a prefix-cache entry no sequence holds. Every
cached block is indexed by the prefix cache, in exactly one pool.

Eviction: when the device needs a block and none is free, the least recently
used cached block that has no child on the device goes (leaves before parents,
so the device's cached blocks always form whole prefixes). With the host tier
it is copied there, the host evicting its own least recently used leaf for
room; without, it is dropped. A lookup that finds blocks on the host gives
them device blocks and copies them back instead of recomputing them.

Preemption: a sequence's leading blocks already in the prefix cache stay there
(they are found again by lookup on readmission). Its other computed blocks are
swapped to the host when that costs less than recomputing them (see
``_swap_pays``); otherwise it is recomputed from what the cache still holds.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from lmport.paging.allocator import BlockAllocator
from lmport.paging.host_tier import CopyBatch, CopyQueue
from lmport.paging.prefix_cache import CachedBlock, ExtraKeys, PrefixCache
from lmport.sequence import Sequence
from lmport.units import ceil_div

# Bytes the host link moves in the time the device does one FLOP of prefill. A
# PCIe 4/5 link (25-50 GB/s) against the 50-100 TFLOP/s an accelerator reaches
# in prefill gives 2.5e-4 to 1e-3; a CPU backend's memcpy against its FLOP rate
# is far higher, so this errs towards recomputing there.
LINK_BYTES_PER_FLOP = 5e-4


@dataclass
class _SeqCache:
    """A sequence's place in the prefix cache."""

    extra: ExtraKeys
    hashes: list[bytes] = field(default_factory=list)         # chained hashes of its full blocks so far
    entries: list[CachedBlock] = field(default_factory=list)  # entries of block_table[:len(entries)]
    stopped: bool = False       # a hash collision: its later blocks are not cached


@dataclass
class _Swap:
    num_cached_blocks: int      # leading blocks left to the prefix cache
    host_blocks: list[int]      # the following blocks, copied to the host pool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, bytes_per_block: int = 0, flops_per_token: float = 0.0,
                 seed: bytes = b"", link_bytes_per_flop: float = LINK_BYTES_PER_FLOP):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.cache = PrefixCache(block_size, seed) if enable_prefix_caching else None
        self.host = BlockAllocator(num_host_blocks) if num_host_blocks > 0 else None
        self.copies = CopyQueue()
        self.bytes_per_block = bytes_per_block
        self.flops_per_token = flops_per_token
        self.link_bytes_per_flop = link_bytes_per_flop
        self._seqs: dict[Sequence, _SeqCache] = {}
        self._swapped: dict[Sequence, _Swap] = {}
        self.stats: Counter[str] = Counter()

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: free ones plus cached ones no sequence holds (evictable)."""
        return self.allocator.num_free + self.allocator.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    # -- running sequences ------------------------------------------------
    def _missing(self, seq: Sequence, num_new: int) -> int:
        return max(0, self.blocks_for(seq.num_computed + num_new) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new: int) -> bool:
        """Whether ``num_new`` more tokens of ``seq`` fit in the free (or evictable) blocks."""
        return self._missing(seq, num_new) <= self.num_free

    def allocate(self, seq: Sequence, num_new: int) -> None:
        seq.block_table.extend(self._allocate(self._missing(seq, num_new)))

    def free(self, seq: Sequence) -> None:
        self.cache_computed(seq)
        # Tail first: a sequence's later blocks become older in the LRU than its earlier ones.
        for block in reversed(seq.block_table):
            self.allocator.decref(block, keep=self.cache is not None and block in self.cache.device)
        seq.block_table.clear()
        self._seqs.pop(seq, None)
        swap = self._swapped.pop(seq, None)
        if swap is not None:
            for b in swap.host_blocks:
                self.host.decref(b)

    def cache_computed(self, seq: Sequence) -> None:
        """Index ``seq``'s newly computed full blocks in the prefix cache."""
        if self.cache is None:
            return
        st = self._state(seq)
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))   # a swapped-out sequence holds none
        if st.stopped or len(st.entries) >= full:
            return
        tokens = seq.token_ids
        self.cache.chain(tokens, st.extra, st.hashes, full)
        for i in range(len(st.entries), full):
            parent = st.entries[-1] if st.entries else None
            block_tokens, h = tokens[i * bs:(i + 1) * bs], st.hashes[i]
            e = self.cache.by_hash.get(h)
            if e is None:
                e = self.cache.add(h, block_tokens, st.extra, parent, seq.block_table[i])
            elif self.cache.get(h, block_tokens, st.extra, parent) is e:
                self._adopt(seq, i, e)
            else:
                st.stopped = True
                self.stats["hash_collisions"] += 1
                return
            st.entries.append(e)

    def _adopt(self, seq: Sequence, i: int, e: CachedBlock) -> None:
        """``seq`` computed block ``i`` although ``e`` already holds the same KV: keep one copy."""
        own = seq.block_table[i]
        if e.on_host:   # ours becomes the entry's device copy; the host copy goes
            self.host.evict(e.block)
            self.cache.move(e, False, own)
        else:           # share the entry's block, free ours
            self._hold(e.block)
            seq.block_table[i] = e.block
            self.allocator.decref(own)

    # -- admission (waiting sequences) --------------------------------------
    def admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence blocks for up to ``budget`` tokens to compute this step, reusing
        cached ones (and copying host ones back) or swapping it back in. Returns the number of
        tokens to compute, or None when it does not fit now."""
        bs, swap = self.block_size, self._swapped.get(seq)
        hits: list[CachedBlock] = []
        if self.cache is not None:
            st = self._state(seq)
            # The last token is always recomputed: its logits give the next token.
            limit = swap.num_cached_blocks if swap else (seq.num_tokens - 1) // bs
            tokens = seq.token_ids
            hits = self.cache.match(tokens, st.extra, self.cache.chain(tokens, st.extra, st.hashes, limit)[:limit])
        if swap is not None and len(hits) < swap.num_cached_blocks:
            # Part of the prefix it left to the cache is gone: recompute from there.
            self._release_swap(seq)
            swap, seq.num_computed = None, 0
        computed = seq.num_computed if swap else len(hits) * bs
        n = min(seq.num_tokens - computed, budget)
        on_device = [e for e in hits if not e.on_host]
        on_host = [e for e in hits if e.on_host]
        held_if_taken = sum(self.allocator.is_cached(e.block) for e in on_device)
        if self.blocks_for(computed + n) - len(on_device) > self.num_free - held_if_taken:
            return None

        for e in on_device:
            self._hold(e.block)
        for e in on_host:       # pinned, so making device room cannot evict them from the host
            self.host.take(e.block)
        for e in on_host:
            (block,) = self._allocate(1)
            self.copies.add(False, e.block, block)
            self.host.decref(e.block)
            self.cache.move(e, False, block)
        seq.block_table[:] = [e.block for e in hits]
        if swap is not None:
            blocks = self._allocate(len(swap.host_blocks))
            for h, d in zip(swap.host_blocks, blocks):
                self.copies.add(False, h, d)
                self.host.decref(h)
            seq.block_table.extend(blocks)
            del self._swapped[seq]
            self.stats["swap_ins"] += 1
        seq.num_computed = computed
        self.allocate(seq, n)

        if self.cache is not None:
            st.entries = hits
            counts = {"device": len(on_device), "host": len(on_host), "miss": limit - len(hits)}
            for tier, count in counts.items():
                seq.prefix_hits[tier] = seq.prefix_hits.get(tier, 0) + count
                self.stats[f"lookup_{tier}"] += count
            if seq.num_preemptions == 0:
                seq.num_cached_prefix = len(hits) * bs
        return n

    # -- preemption --------------------------------------------------------
    def preempt(self, seq: Sequence) -> bool:
        """Release a running sequence's blocks. True when its uncached blocks were swapped to the
        host (it keeps ``num_computed``); False when it will be recomputed (``num_computed`` = 0)."""
        self.cache_computed(seq)
        k = len(self._seqs[seq].entries) if seq in self._seqs else 0
        private = seq.block_table[k:self.blocks_for(seq.num_computed)]
        swap = None
        if self.host is not None and private and self._swap_pays(seq, k, len(private)):
            host_blocks = self._host_allocate(len(private))
            for d, h in zip(private, host_blocks):
                self.copies.add(True, d, h)
            swap = _Swap(k, host_blocks)
        self.free(seq)
        if swap is not None:
            self._swapped[seq] = swap
            self.stats["preempt_swap"] += 1
        else:
            seq.num_computed = 0
            self.stats["preempt_recompute"] += 1
        return swap is not None

    def _swap_pays(self, seq: Sequence, num_cached_blocks: int, num_blocks: int) -> bool:
        """The cost rule: swap when copying the blocks out and back costs less link time than
        recomputing their tokens costs device time, i.e. when

            2 * num_blocks * bytes_per_block  <  tokens * flops_per_token * LINK_BYTES_PER_FLOP

        with tokens = computed tokens past the prefix-cached blocks (those come back from the
        cache either way), and only when the host can take the blocks (evicting cached ones)."""
        if self.host.num_free + self.host.num_cached < num_blocks:
            return False
        tokens = seq.num_computed - num_cached_blocks * self.block_size
        return 2 * num_blocks * self.bytes_per_block < tokens * self.flops_per_token * self.link_bytes_per_flop

    def _release_swap(self, seq: Sequence) -> None:
        for b in self._swapped.pop(seq).host_blocks:
            self.host.decref(b)

    # -- blocks and eviction ---------------------------------------------------
    def _state(self, seq: Sequence) -> _SeqCache:
        st = self._seqs.get(seq)
        if st is None:
            extra = (("cache_salt", seq.cache_salt),) if seq.cache_salt is not None else ()
            st = self._seqs[seq] = _SeqCache(extra)
        return st

    def _hold(self, block: int) -> None:
        if self.allocator.is_cached(block):
            self.allocator.take(block)
        else:
            self.allocator.incref(block)

    def _allocate(self, n: int) -> list[int]:
        while self.allocator.num_free < n:
            self._evict_device()
        return self.allocator.allocate(n)

    def _evict_device(self) -> None:
        block = self._victim(self.allocator, self.cache.device, on_host=False)
        e = self.cache.device[block]
        slot = self._host_slot() if self.host is not None else None
        if slot is None:
            self.cache.drop(e)
        else:
            self.copies.add(True, block, slot)
            self.cache.move(e, True, slot)
        self.allocator.evict(block)
        self.stats["device_evictions"] += 1

    def _evict_host(self) -> None:
        block = self._victim(self.host, self.cache.host, on_host=True)
        self.cache.drop(self.cache.host[block])
        self.host.evict(block)
        self.stats["host_evictions"] += 1

    def _host_slot(self) -> int | None:
        """A host block for an entry leaving the device (None when every host block is swapped-out KV)."""
        if self.host.num_free == 0 and self.host.num_cached == 0:
            return None
        if self.host.num_free == 0:
            self._evict_host()
        (slot,) = self.host.allocate(1)
        self.host.decref(slot, keep=True)
        return slot

    def _host_allocate(self, n: int) -> list[int]:
        while self.host.num_free < n:
            self._evict_host()
        return self.host.allocate(n)

    def _victim(self, allocator: BlockAllocator, entries: dict[int, CachedBlock], on_host: bool) -> int:
        """Least recently used cached block with no child in its pool (on the host: no child at all)."""
        first = None
        for block in allocator.lru():
            children = entries[block].children
            if (not children) if on_host else all(c.on_host for c in children):
                return block
            first = block if first is None else first
        # Unreachable while every holder of a block also holds its parent; kept so eviction cannot fail.
        self.stats["lru_fallbacks"] += 1
        return first

    def take_copies(self) -> list[CopyBatch]:
        """The device<->host copies queued since the last call, in order; run them before the forward."""
        return self.copies.take()

    # -- observability -------------------------------------------------------
    def usage(self) -> dict:
        s, host = self.stats, self.host
        queried = s["lookup_device"] + s["lookup_host"] + s["lookup_miss"]

        def rate(n):
            return n / queried if queried else 0.0
        return {
            "prefix_caching": self.cache is not None,
            "device_blocks_cached": self.allocator.num_cached,
            "host_blocks_total": host.num_blocks if host else 0,
            "host_blocks_cached": host.num_cached if host else 0,
            "host_blocks_swapped": host.num_used if host else 0,
            "prefix_cache_queried_blocks": queried,
            "prefix_cache_hit_blocks_device": s["lookup_device"],
            "prefix_cache_hit_blocks_host": s["lookup_host"],
            "prefix_cache_miss_blocks": s["lookup_miss"],
            "prefix_cache_hit_rate": rate(s["lookup_device"] + s["lookup_host"]),
            "prefix_cache_device_hit_rate": rate(s["lookup_device"]),
            "prefix_cache_host_hit_rate": rate(s["lookup_host"]),
            "device_cache_evictions": s["device_evictions"],
            "host_cache_evictions": s["host_evictions"],
            "hash_collisions": s["hash_collisions"],
            "preempt_swap": s["preempt_swap"],
            "preempt_recompute": s["preempt_recompute"],
            "blocks_to_host": self.copies.blocks_to_host,
            "blocks_from_host": self.copies.blocks_from_host,
            "bytes_to_host": self.copies.blocks_to_host * self.bytes_per_block,
            "bytes_from_host": self.copies.blocks_from_host * self.bytes_per_block,
        }

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
            if any(self.allocator.ref_counts[b] != holders[b] for b in range(self.num_blocks)):
                raise AssertionError("a device block's ref count differs from the tables holding it")
