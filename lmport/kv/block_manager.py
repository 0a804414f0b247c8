"""Per-sequence block tables over the device pool, with the prefix cache and the host tier.

Accounting (checked after every step of the tests' randomized workloads, tests/support), on each pool:
  device: free + used + cached = total
  host:   free + used + cached = total, used = blocks of swapped-out sequences
where used = referenced by a sequence (its ref count is the number of block
tables holding it), cached = a prefix-cache entry no sequence holds. Every
cached block is indexed by the prefix cache, in exactly one pool.

Eviction and the swap cost rule are the manager's ``Evictor`` (``lmport.kv.eviction``),
the usage report a function over its state (``lmport.kv.usage``). A lookup that finds blocks on the host gives them
device blocks and copies them back instead of recomputing them.

Preemption: a sequence's leading blocks already in the prefix cache stay there
(they are found again by lookup on readmission). Its other computed blocks are
swapped to the host when that costs less than recomputing them (see
``Evictor.swap_pays``); otherwise it is recomputed from what the cache still holds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lmport.kv.allocator import BlockAllocator
from lmport.kv.eviction import LINK_BYTES_PER_FLOP, Evictor
from lmport.kv.host_tier import CopyBatch, CopyQueue
from lmport.kv.prefix_cache import CachedBlock, ExtraKeys, PrefixCache
from lmport.kv.usage import usage
from lmport.kv.window import HOLE, release_outside_window
from lmport.sched.sequence import Sequence
from lmport.units import ceil_div


@dataclass
class _SeqCache:
    """A sequence's place in the prefix cache."""

    extra: ExtraKeys
    hashes: list[bytes] = field(default_factory=list)         # chained hashes of its full blocks so far
    entries: list[CachedBlock] = field(default_factory=list)  # entries of block_table[:len(entries)]
    stopped: bool = False       # a hash collision: its later blocks are not cached


@dataclass
class Swap:
    num_cached_blocks: int      # leading blocks left to the prefix cache
    host_blocks: list[int]      # the following blocks, copied to the host pool


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, bytes_per_block: int = 0, flops_per_token: float = 0.0,
                 seed: bytes = b"", link_bytes_per_flop: float = LINK_BYTES_PER_FLOP, window: int | None = None):
        self.block_size = block_size
        self.window = window    # every layer's attention window is at most this (None: some layer reads all)
        self.allocator = BlockAllocator(num_blocks)
        self.cache = PrefixCache(block_size, seed) if enable_prefix_caching else None
        self.host = BlockAllocator(num_host_blocks) if num_host_blocks > 0 else None
        self.copies = CopyQueue()
        self.bytes_per_block = bytes_per_block
        self._seqs: dict[Sequence, _SeqCache] = {}
        self.swapped: dict[Sequence, Swap] = {}     # preempted sequences whose blocks wait on the host
        self.stats: Counter[str] = Counter()
        self.evictor = Evictor(self.allocator, self.cache, self.host, self.copies, self.stats, block_size=block_size,
                               bytes_per_block=bytes_per_block, flops_per_token=flops_per_token,
                               link_bytes_per_flop=link_bytes_per_flop)

    def usage(self) -> dict:
        """Pool gauges, prefix-cache lookups, evictions, preemptions and host copies (lmport.kv.usage)."""
        return usage(self.allocator, self.cache, self.host, self.copies, self.stats, self.bytes_per_block)

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

    def release_outside_window(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks its next token can no longer read (lmport.kv.window), once indexed."""
        if self.window is not None and seq.block_table:
            self.cache_computed(seq)
            release_outside_window(self.allocator, self.cache, seq.block_table, seq.num_computed, self.window,
                                   self.block_size)

    def rollback(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give back ``seq``'s blocks past its computed tokens (or its first ``num_tokens``): a verified
        proposal's rejected tokens had KV slots there. No such block is in the prefix cache (it indexes full
        computed blocks only); the slots of rejected tokens in the last kept block are overwritten by the next
        tokens computed."""
        keep = self.blocks_for(seq.num_computed if num_tokens is None else num_tokens)
        while len(seq.block_table) > keep:
            self.allocator.decref(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        self.cache_computed(seq)
        # Tail first: a sequence's later blocks become older in the LRU than its earlier ones.
        for block in reversed(seq.block_table):
            if block != HOLE:
                self.allocator.decref(block, keep=self.cache is not None and block in self.cache.device)
        seq.block_table.clear()
        self._seqs.pop(seq, None)
        swap = self.swapped.pop(seq, None)
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

    def prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes the prefix cache names ``seq``'s first ``num_blocks`` full blocks of tokens by (a chain:
        each names the whole prefix through its block); none without a prefix cache, and none past a hash
        collision, whose blocks are not cached."""
        if self.cache is None:
            return []
        st = self._state(seq)
        if st.stopped:
            num_blocks = min(num_blocks, len(st.entries))
        return self.cache.chain(seq.token_ids, st.extra, st.hashes, num_blocks)[:num_blocks]

    def _adopt(self, seq: Sequence, i: int, e: CachedBlock) -> None:
        """``seq`` computed block ``i`` although ``e`` already holds the same KV: keep one copy."""
        own = seq.block_table[i]
        if e.on_host:   # ours becomes the entry's device copy; the host copy goes
            self.host.evict(e.block)
            self.cache.move(e, own, on_host=False)
        else:           # share the entry's block, free ours
            self._hold(e.block)
            seq.block_table[i] = e.block
            self.allocator.decref(own)

    # -- admission (waiting sequences) --------------------------------------
    def admit(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting sequence blocks for up to ``budget`` tokens to compute this step, reusing
        cached ones (and copying host ones back) or swapping it back in. Returns the number of
        tokens to compute, or None when it does not fit now."""
        bs, swap = self.block_size, self.swapped.get(seq)
        hits: list[CachedBlock] = []
        last: CachedBlock | None = None   # a cached last block, copied into one of the sequence's own
        if self.cache is not None:
            st = self._state(seq)
            # The last token is always recomputed: its logits give the next token. When it ends a block and
            # that block is cached too, the sequence goes on in a copy of it, recomputing that one token.
            whole = swap is None and not seq.scoring and seq.num_tokens % bs == 0
            limit = swap.num_cached_blocks if swap else (seq.num_tokens - (0 if whole else 1)) // bs
            if seq.scoring:   # positions whose logprobs are wanted are computed, not taken from the cache
                limit = min(limit, len(seq.prompt_logprobs) // bs)
            tokens = seq.token_ids
            hits = self.cache.match(tokens, st.extra, self.cache.chain(tokens, st.extra, st.hashes, limit)[:limit])
            if whole and len(hits) * bs == seq.num_tokens:
                last = hits.pop()
        if swap is not None and len(hits) < swap.num_cached_blocks:
            # Part of the prefix it left to the cache is gone: recompute from there.
            self._release_swap(seq)
            swap, seq.num_computed = None, 0
        computed = seq.num_computed if swap else len(hits) * bs + (bs - 1 if last else 0)
        n = min(seq.num_tokens - computed, budget)
        on_device = [e for e in hits if not e.on_host]
        on_host = [e for e in hits if e.on_host]
        # Held while blocks are made: the hits for good, ``last`` until its copy is queued (below).
        held = hits + ([last] if last is not None else [])
        held_on_device = [e for e in held if not e.on_host]
        held_on_host = [e for e in held if e.on_host]
        held_if_taken = sum(self.allocator.is_cached(e.block) for e in held_on_device)
        if self.blocks_for(computed + n) - len(on_device) > self.num_free - held_if_taken:
            return None

        for e in held_on_device:
            self._hold(e.block)
        for e in held_on_host:   # pinned, so making device room cannot evict them from the host
            self.host.take(e.block)
        for e in on_host:
            (block,) = self._allocate(1)
            self.copies.add(e.block, block, to_host=False)
            self.host.decref(e.block)
            self.cache.move(e, block, on_host=False)
        seq.block_table[:] = [e.block for e in hits]
        if last is not None:
            (own,) = self._allocate(1)
            if last.on_host:
                self.copies.add(last.block, own, to_host=False)
                self.host.decref(last.block, keep=True)
            else:
                self.copies.add_on_device(last.block, own)
                self.allocator.decref(last.block, keep=True)   # cached again, read before any reuse
            seq.block_table.append(own)
        if swap is not None:
            blocks = self._allocate(len(swap.host_blocks))
            for h, d in zip(swap.host_blocks, blocks):
                self.copies.add(h, d, to_host=False)
                self.host.decref(h)
            seq.block_table.extend(blocks)
            del self.swapped[seq]
            self.stats["swap_ins"] += 1
        seq.num_computed = computed
        self.allocate(seq, n)

        if self.cache is not None:
            st.entries = hits
            counts = {"device": len(held_on_device), "host": len(held_on_host), "miss": limit - len(held)}
            for tier, count in counts.items():
                seq.prefix_hits[tier] = seq.prefix_hits.get(tier, 0) + count
                self.stats[f"lookup_{tier}"] += count
            if seq.num_preemptions == 0:
                seq.num_cached_prefix = computed
        return n

    # -- preemption --------------------------------------------------------
    def preempt(self, seq: Sequence) -> bool:
        """Release a running sequence's blocks. True when its uncached blocks were swapped to the
        host (it keeps ``num_computed``); False when it will be recomputed (``num_computed`` = 0)."""
        self.cache_computed(seq)
        k = len(self._seqs[seq].entries) if seq in self._seqs else 0
        private = seq.block_table[k:self.blocks_for(seq.num_computed)]
        swap = None
        # A sequence whose window freed some of its blocks is recomputed (its holes cannot be swapped back).
        if self.host is not None and private and HOLE not in private and self.evictor.swap_pays(seq, k, len(private)):
            host_blocks = self.evictor.host_allocate(len(private))
            for d, h in zip(private, host_blocks):
                self.copies.add(d, h, to_host=True)
            swap = Swap(k, host_blocks)
        self.free(seq)
        if swap is not None:
            self.swapped[seq] = swap
            self.stats["preempt_swap"] += 1
        else:
            seq.num_computed = 0
            self.stats["preempt_recompute"] += 1
        return swap is not None

    def _release_swap(self, seq: Sequence) -> None:
        for b in self.swapped.pop(seq).host_blocks:
            self.host.decref(b)

    # -- blocks and eviction ---------------------------------------------------
    def _state(self, seq: Sequence) -> _SeqCache:
        st = self._seqs.get(seq)
        if st is None:
            extra = (("cache_salt", seq.cache_salt),) if seq.cache_salt is not None else ()
            if seq.adapter_id:   # K/V computed under a LoRA adapter are that adapter's own
                extra += (("adapter", str(seq.adapter_id)),)
            if seq.images_key is not None:   # the same tokens over other images are other K/V
                extra += (("images", seq.images_key),)
            st = self._seqs[seq] = _SeqCache(extra)
        return st

    def _hold(self, block: int) -> None:
        if self.allocator.is_cached(block):
            self.allocator.take(block)
        else:
            self.allocator.incref(block)

    def _allocate(self, n: int) -> list[int]:
        while self.allocator.num_free < n:
            self.evictor.evict_device()
        return self.allocator.allocate(n)

    def take_copies(self) -> list[CopyBatch]:
        """The device<->host copies queued since the last call, in order; run them before the forward."""
        return self.copies.take()
