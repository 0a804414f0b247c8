"""Block manager, prefix cache and host tier without a model.

A fake engine drives the real Scheduler and BlockManager: every cache slot
holds a digest of the token prefix its token ends, written when the token is
"computed", moved by the queued host<->device copies, and checked before each
forward. A sequence whose history reads back wrong digests would have attended
to another prefix's KV: that is what a bad hit, a lost copy or a reused block
would show as. Invariants are checked after every step. With speculation, the KV of rejected proposals
is written too, and must never be read.
"""
from __future__ import annotations

import random

import pytest

from lmport.config import GenerationConfig
from lmport.kv.allocator import BlockAllocator, OutOfBlocks
from lmport.kv.block_manager import BlockManager
from lmport.kv.host_tier import CopyQueue
from lmport.kv.prefix_cache import PrefixCache, block_hash, model_fingerprint
from lmport.sched.scheduler import Scheduler
from lmport.sched.sequence import Sequence, Status
from support.paging_invariants import check_block_manager

GEN = GenerationConfig(max_new_tokens=1)


def colliding_hash(parent, tokens, extra):
    """Three hash values for every block there is: collisions everywhere."""
    return bytes([sum(tokens) % 3])


class FakeEngine:
    def __init__(self, num_blocks=24, block_size=4, budget=32, max_batch=6, caching=True, host_blocks=0,
                 link_bytes_per_flop=1.0, seed=0, speculate=False):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching, num_host_blocks=host_blocks,
                               bytes_per_block=1, flops_per_token=1.0, link_bytes_per_flop=link_bytes_per_flop)
        self.sched = Scheduler(self.bm, max_batch, budget)
        self.block_size = block_size
        self.pools = {False: [[None] * block_size for _ in range(num_blocks)],
                      True: [[None] * block_size for _ in range(host_blocks)]}
        self.rng = random.Random(seed)
        self.seqs: list[Sequence] = []
        self.max_new: dict[Sequence, int] = {}
        self._digests: dict[Sequence, list[int]] = {}
        self.steps = 0
        # Speculation as the engine runs it: random proposals verified with the sequence's last token, a
        # random number of them accepted, the KV slots of the rejected ones given back (BlockManager.rollback).
        self.proposals: dict[Sequence, list[int]] = {}
        self.accepted = self.rejected = 0
        if speculate:
            self.sched.lookahead = self.lookahead

    def add(self, prompt, max_new=4, salt=None) -> Sequence:
        seq = Sequence(f"r{len(self.seqs)}", list(prompt), GEN, cache_salt=salt)
        self.seqs.append(seq)
        self.max_new[seq] = max_new
        self.sched.add(seq)
        return seq

    def digests(self, seq) -> list[int]:
        d = self._digests.setdefault(seq, [])
        ids = seq.token_ids
        for t in ids[len(d):]:
            d.append(hash((d[-1] if d else None, t)))
        return d

    def lookahead(self, seq) -> int:
        room = self.max_new[seq] - len(seq.output_ids) - 1   # the target adds a token of its own
        self.proposals[seq] = [self.rng.randrange(50) for _ in range(max(0, min(self.rng.randrange(5), room)))]
        return len(self.proposals[seq])

    def propose(self, seq, slots: int) -> list[int]:
        """The proposal for the ``slots`` the scheduler reserved; now and then a shorter one, whose unused
        slots are given back as the engine gives them back."""
        proposal = self.proposals.pop(seq)[:slots]
        if proposal and self.rng.random() < 0.2:
            proposal = proposal[:self.rng.randrange(len(proposal))]
            self.bm.rollback(seq, seq.num_computed + 1 + len(proposal))
        return proposal

    def slot(self, seq, pos):
        return self.pools[False][seq.block_table[pos // self.block_size]][pos % self.block_size]

    def live(self):
        return [s for s in self.seqs if s.status is not Status.FINISHED]

    def step(self) -> None:
        batch = self.sched.schedule()
        proposals = {seq: self.propose(seq, n - 1) for seq, n in zip(batch.seqs, batch.num_new)
                     if n > seq.num_uncomputed}
        num_new = [1 + len(proposals[seq]) if seq in proposals else n for seq, n in zip(batch.seqs, batch.num_new)]
        for b in batch.copies:   # the block copies scheduling queued
            assert len(set(b.dst)) == len(b.dst), "a batch writes a block twice: the result is undefined"
            src, dst = self.pools[b.source == "host"], self.pools[b.target == "host"]
            rows = [list(src[s]) for s in b.src]    # read all, then write: one batched copy
            for d, row in zip(b.dst, rows):
                dst[d] = row
        for seq, n in zip(batch.seqs, num_new):
            want = list(self.digests(seq))
            for pos in range(seq.num_computed):
                assert self.slot(seq, pos) == want[pos], f"{seq.request_id} reads wrong KV at {pos}"
            for t in proposals.get(seq, ()):    # the proposed tokens' KV, as if they were the sequence's
                want.append(hash((want[-1], t)))
            for pos in range(seq.num_computed, seq.num_computed + n):
                self.pools[False][seq.block_table[pos // self.block_size]][pos % self.block_size] = want[pos]
        for seq, n in zip(batch.seqs, num_new):
            proposal = proposals.get(seq, [])
            seq.num_computed += n - len(proposal)
            if seq.num_uncomputed == 0:
                accepted = self.rng.randrange(len(proposal) + 1)
                self.accepted, self.rejected = self.accepted + accepted, self.rejected + len(proposal) - accepted
                seq.output_ids += proposal[:accepted] + [self.rng.randrange(50)]
                seq.num_computed += accepted
                if len(seq.output_ids) >= self.max_new[seq]:
                    self.sched.finish(seq)
                    seq.finish("length")
                elif proposal:
                    self.bm.rollback(seq)
        self.steps += 1
        self.check()

    def abort(self, seq) -> None:
        self.sched.finish(seq)
        seq.finish("abort")

    def check(self) -> None:
        bm = self.bm
        check_block_manager(bm, self.live())
        assert bm.stats["lru_fallbacks"] == 0, "evicted a block whose child was still cached in its pool"
        if bm.cache is not None:   # the device's cached blocks form whole prefixes
            for e in bm.cache.device.values():
                assert e.parent is None or (e.parent.alive and not e.parent.on_host), e

    def run(self, max_steps=5000) -> None:
        while self.sched.has_unfinished():
            self.step()
            assert self.steps < max_steps, "no progress"


# -- allocator ------------------------------------------------------------------------------------------------


def test_allocator_states_and_lru():
    a = BlockAllocator(4)
    b0, b1, b2 = a.allocate(3)
    a.incref(b0)
    assert not a.decref(b0)
    assert a.decref(b0, keep=True) and a.decref(b1, keep=True) and a.decref(b2)
    assert (a.num_free, a.num_used, a.num_cached) == (2, 0, 2)
    assert list(a.lru()) == [b0, b1]
    a.take(b0)
    a.decref(b0, keep=True)
    assert list(a.lru()) == [b1, b0]        # a hit makes it the most recently used
    a.evict(b1)
    a.check_invariants()
    with pytest.raises(ValueError):
        a.decref(b1)                        # free: a ref count never goes negative
    with pytest.raises(ValueError):
        a.incref(b0)                        # cached: take() it, not incref
    assert min(a.ref_counts) == 0


@pytest.mark.parametrize("seed", range(4))
def test_allocator_random_operations_match_a_model(seed):
    """Every operation in every state it is allowed in, checked against plain dicts after each: ref counts,
    free + used + cached = total, and the LRU order of cached blocks (released or hit last: most recent)."""
    rng, total = random.Random(seed), 16
    a = BlockAllocator(total)
    refs: dict[int, int] = {}
    cached: list[int] = []        # least recently used first
    for _ in range(1500):
        op = rng.choice(["allocate", "incref", "decref", "decref", "take", "evict"])
        free = total - len(refs) - len(cached)
        if op == "allocate":
            n = rng.randint(1, free + 1)
            if n > free:
                with pytest.raises(OutOfBlocks):
                    a.allocate(n)
                continue
            for b in a.allocate(n):
                assert b not in refs and b not in cached, "allocated a block that is not free"
                refs[b] = 1
        elif op == "incref" and refs:
            b = rng.choice(list(refs))
            a.incref(b)
            refs[b] += 1
        elif op == "decref" and refs:
            b, keep = rng.choice(list(refs)), rng.random() < 0.5
            refs[b] -= 1
            assert a.decref(b, keep=keep) == (refs[b] == 0)
            if not refs[b]:
                del refs[b]
                if keep:
                    cached.append(b)
        elif op == "take" and cached:
            b = rng.choice(cached)
            a.take(b)
            cached.remove(b)
            refs[b] = 1
        elif op == "evict" and cached:
            a.evict(cached.pop(0))
        a.check_invariants()
        assert a.ref_counts == [refs.get(b, 0) for b in range(total)]
        assert (a.num_free, a.num_used, a.num_cached) == (total - len(refs) - len(cached), len(refs), len(cached))
        assert list(a.lru()) == cached


def test_copy_queue_keeps_order_and_batches_by_direction():
    q = CopyQueue()
    q.add(1, 7, to_host=True)
    q.add(2, 8, to_host=True)
    q.add(7, 3, to_host=False)      # reads host 7 after it was written
    q.add(4, 7, to_host=True)       # host 7 reused after it was read: a later batch
    q.add(5, 7, to_host=True)       # a second write to 7: not in the same batch as the first
    q.add_on_device(3, 9)           # device 3 read after it was written from the host
    assert [(b.source, b.target, b.src, b.dst) for b in q.take()] == [
        ("device", "host", [1, 2], [7, 8]), ("host", "device", [7], [3]), ("device", "host", [4], [7]),
        ("device", "host", [5], [7]), ("device", "device", [3], [9])]
    assert (q.blocks_to_host, q.blocks_from_host, len(q)) == (4, 1, 0)


# -- hashing ------------------------------------------------------------------------------------------------------


def test_block_hash_is_stable_and_covers_parent_tokens_and_extras():
    seed = model_fingerprint("m", 0)
    h = block_hash(seed, [1, 2, 3, 4])
    # blake2b over a fixed encoding: the same in every process and run (Python's hash() is not).
    assert h.hex() == "09e38a9ad7a0628636db5523edc6cc49"
    others = [block_hash(model_fingerprint("m", 8), [1, 2, 3, 4]), block_hash(seed, [1, 2, 4, 3]),
              block_hash(seed, [1, 2, 3, 4], (("cache_salt", "a"),)), block_hash(h, [1, 2, 3, 4]),
              block_hash(seed, [1, 2, 3, 4], (("cache_salt", ""),)), block_hash(seed, [1, 2, 3])]
    assert len({h, *others}) == 1 + len(others)


def test_a_blocks_hash_names_its_whole_prefix():
    """chain(): a block's hash changes with any earlier block, so equal blocks under different prefixes are
    different entries (found by hash, not only refused by the parent check)."""
    cache = PrefixCache(4, model_fingerprint("m"))
    a = cache.chain([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], (), [], 3)
    b = cache.chain([1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12], (), [], 3)   # only the first block differs
    assert len(set(a) | set(b)) == 6
    assert a == cache.chain([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], (), a[:1], 3)   # extends a chain


# -- lookups, sharing, eviction ----------------------------------------------------------------------------------------


def _run_one(eng: FakeEngine, prompt, max_new=1, salt=None) -> Sequence:
    seq = eng.add(prompt, max_new, salt)
    eng.run()
    return seq


def test_hits_share_blocks_and_last_token_is_recomputed():
    eng = FakeEngine(num_blocks=16, block_size=4)
    a = _run_one(eng, range(12))                     # 3 full blocks
    assert a.prefix_hits == {"device": 0, "host": 0, "miss": 3}
    cached_last = next(e.block for e in eng.bm.cache.by_hash.values() if e.tokens == (8, 9, 10, 11))
    # The same prompt: all 3 blocks hit; the last one is copied into a block of its own and only the last
    # token is recomputed there (the simulator checks every slot it reads).
    b = eng.add(list(range(12)), 2)
    c = eng.add(list(range(9)) + [99, 98, 97, 96], 2)  # partial overlap: 2 blocks
    eng.step()
    assert b.num_computed == 12 and c.num_computed == 13
    assert b.block_table[:2] == c.block_table[:2] and b.block_table[2] != cached_last
    assert eng.bm.allocator.ref_counts[b.block_table[0]] == 2
    assert b.num_cached_prefix == 11 and b.prefix_hits == {"device": 3, "host": 0, "miss": 0}
    assert c.num_cached_prefix == 8 and c.prefix_hits == {"device": 2, "host": 0, "miss": 1}
    eng.run()
    assert eng.bm.usage()["prefix_cache_hit_rate"] == pytest.approx(5 / 9)


def test_cache_salt_isolates_requests():
    eng = FakeEngine(num_blocks=16, block_size=4)
    _run_one(eng, range(12), salt="tenant-a")
    assert _run_one(eng, range(12), salt="tenant-b").num_cached_prefix == 0
    assert _run_one(eng, range(12)).num_cached_prefix == 0
    assert _run_one(eng, range(12), salt="tenant-a").num_cached_prefix == 11


def test_forced_collision_never_returns_wrong_blocks():
    eng = FakeEngine(num_blocks=16, block_size=4)
    eng.bm.cache.hash_fn = colliding_hash
    a = _run_one(eng, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # [2, 1, 3, 4] hashes like [1, 2, 3, 4] (same sum): found in the index, refused by the token check.
    b = _run_one(eng, [2, 1, 3, 4, 5, 6, 7, 8, 9])
    assert a.num_cached_prefix == 0 and b.num_cached_prefix == 0
    # Same tokens under a different parent: the second block's hash collides, its parent does not verify.
    c = _run_one(eng, [1, 2, 3, 5, 5, 6, 7, 8, 9])
    assert c.num_cached_prefix == 0
    assert eng.bm.stats["hash_collisions"] >= 1
    d = _run_one(eng, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert d.num_cached_prefix == 8                  # a true hit still hits


def test_forced_collision_on_the_same_tokens_under_another_parent_is_refused():
    """colliding_hash ignores the parent: block B after C finds the entry of B after A, equal tokens and all.
    Only the parent check refuses it (reading it would read KV computed after A)."""
    eng = FakeEngine(num_blocks=16, block_size=4)
    eng.bm.cache.hash_fn = colliding_hash
    a, b, c = [3, 3, 3, 3], [1, 0, 0, 0], [2, 0, 0, 0]   # one of the three hash values each
    _run_one(eng, a + b + [9])
    _run_one(eng, c + [9])
    assert _run_one(eng, c + b + [9]).num_cached_prefix == 4   # C only
    assert _run_one(eng, a + b + [7]).num_cached_prefix == 8   # a true hit still hits


def test_lru_eviction_order_and_leaves_first():
    eng = FakeEngine(num_blocks=8, block_size=4)
    bm = eng.bm
    for p in (1, 2, 3):
        _run_one(eng, [p] * 8 + [0])                      # 2 full blocks each: parent, then child
    assert not bm._seqs                                   # finished sequences leave no state behind

    def lru():
        return [(bm.cache.device[b].tokens[0], bm.cache.device[b].parent is None) for b in bm.allocator.lru()]
    # Released tail first, so each child is older than its parent.
    assert lru() == [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    _run_one(eng, [1] * 8 + [5])                          # a hit on prefix 1 makes it the most recently used
    assert lru() == [(2, False), (2, True), (3, False), (3, True), (1, False), (1, True)]
    bm.evictor.evict_device()
    bm.evictor.evict_device()
    assert lru() == [(3, False), (3, True), (1, False), (1, True)]
    # A parent older than its child (by hand) still waits for the child: the oldest leaf goes.
    bm.allocator._cached.move_to_end(next(bm.allocator.lru()))
    assert lru() == [(3, True), (1, False), (1, True), (3, False)]
    bm.evictor.evict_device()
    assert lru() == [(3, True), (1, True), (3, False)]
    eng.check()


def test_host_tier_keeps_evicted_prefixes_and_copies_them_back():
    eng = FakeEngine(num_blocks=5, block_size=4, host_blocks=8)
    bm = eng.bm
    _run_one(eng, [1] * 8 + [0])
    _run_one(eng, [2] * 8 + [0])
    _run_one(eng, [3] * 8 + [0])                          # 5 device blocks: prefix 1 had to leave the device
    assert bm.usage()["host_blocks_cached"] >= 2 and bm.copies.blocks_to_host >= 2
    s = _run_one(eng, [1] * 8 + [7])
    assert s.prefix_hits == {"device": 0, "host": 2, "miss": 0}
    assert bm.copies.blocks_from_host == 2 and s.num_cached_prefix == 8
    u = bm.usage()
    assert u["prefix_cache_host_hit_rate"] > 0 and u["bytes_from_host"] == 2 * bm.bytes_per_block


def test_host_lru_drops_leaves_first():
    eng = FakeEngine(num_blocks=4, block_size=4, host_blocks=3)
    bm = eng.bm
    for p in (1, 2, 3, 4):
        _run_one(eng, [p] * 8 + [0])
    # Device evictions reach the host child first; the host drops its oldest leaf for room:
    # prefix 1's child, then (now a leaf) its parent.
    assert [(bm.cache.host[b].tokens[0], bm.cache.host[b].parent is None) for b in bm.host.lru()] == \
        [(2, False), (2, True), (3, False)]
    assert bm.stats["host_evictions"] == 2 and bm.copies.blocks_to_host == 5
    assert [(bm.cache.device[b].tokens[0], bm.cache.device[b].parent is None) for b in bm.allocator.lru()] == \
        [(3, True), (4, False), (4, True)]


@pytest.mark.parametrize("link, swapped", [(float("inf"), True), (0.0, False)])
def test_preemption_cost_rule(link, swapped):
    # Without prefix caching every computed block is the sequence's own: swap moves them all.
    eng = FakeEngine(num_blocks=10, block_size=4, budget=64, caching=False, host_blocks=16, link_bytes_per_flop=link)
    a = eng.add([1] * 9, max_new=20)
    b = eng.add([2] * 9, max_new=20)
    eng.run()
    u = eng.bm.usage()
    assert eng.sched.num_preemptions > 0
    assert (u["preempt_swap"] > 0) == swapped and (u["preempt_recompute"] == 0) == swapped
    assert len(a.output_ids) == len(b.output_ids) == 20


def test_swap_rule_counts_only_uncached_tokens():
    bm = BlockManager(8, 4, enable_prefix_caching=True, num_host_blocks=8, bytes_per_block=100,
                      flops_per_token=1.0, link_bytes_per_flop=10.0)
    seq = Sequence("s", list(range(20)), GEN)
    seq.num_computed = 20
    # 3 uncached blocks: 600 bytes out and back; the 12 tokens past 2 cached blocks cost 12 * 10: recompute.
    assert not bm.evictor.swap_pays(seq, 2, 3)
    bm.evictor.link_bytes_per_flop = 100.0
    assert bm.evictor.swap_pays(seq, 2, 3)                      # 600 < 12 * 100
    assert not bm.evictor.swap_pays(seq, 0, 9)                  # more blocks than the host has


def test_swapped_sequence_whose_cached_prefix_is_gone_recomputes():
    eng = FakeEngine(num_blocks=8, block_size=4, host_blocks=8, link_bytes_per_flop=float("inf"))
    bm = eng.bm
    s = eng.add([1] * 10, max_new=3)
    eng.step()                                           # 10 tokens computed: 2 full blocks cached, 1 partial
    eng.sched._preempt(s)
    assert bm.stats["preempt_swap"] == 1 and s.num_computed == 10 and bm.host.num_used == 1
    while bm.allocator.num_cached:                       # its cached prefix leaves the device...
        bm.evictor.evict_device()
    while bm.host.num_cached:                            # ...and the host
        bm.evictor.evict_host()
    eng.run()
    assert len(s.output_ids) == 3 and bm.stats["swap_ins"] == 0 and bm.host.num_used == 0
    assert s.prefix_hits["miss"] == 2 + 2                # the swap's lookup, then the recompute's


def test_duplicate_blocks_are_merged_on_device_and_host():
    # An 8-token prompt looks up only its first block (the last token is recomputed), so a second
    # request recomputes block 1 although it is cached: registration keeps one copy.
    eng = FakeEngine(num_blocks=6, block_size=4, host_blocks=8)
    bm = eng.bm
    a = eng.add(list(range(8)), max_new=4)
    eng.step()
    b = eng.add(list(range(8)), max_new=4)
    eng.step()
    eng.step()
    assert a.block_table[:2] == b.block_table[:2]        # b now shares a's block 1 too
    eng.run()
    while bm.allocator.num_cached:                       # both blocks to the host
        bm.evictor.evict_device()
    c = eng.add(list(range(8)), max_new=1)
    eng.step()                                           # block 0 comes back from the host, block 1 is recomputed
    eng.step()                                           # ...and becomes the device copy of the host entry
    assert bm.cache.by_hash[bm.cache.chain(c.token_ids, (), [], 2)[1]].on_host is False
    assert not bm.cache.host and bm.host.num_cached == 0
    eng.run()


# -- randomized workloads ------------------------------------------------------------------------------------------


def random_workload(eng: FakeEngine, rng: random.Random, num_requests: int):
    """Prompts that share (parts of) a few prefixes, arriving over time, some salted, a few aborted."""
    capacity = eng.bm.num_blocks * eng.block_size      # every request fits alone
    shared = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    pending = []
    for _ in range(num_requests):
        base = rng.choice(shared)
        own = [rng.randrange(50) for _ in range(rng.randrange(8))]
        prompt = base[:rng.randrange(len(base) // 2, len(base) + 1)] + own
        max_new = rng.randrange(1, 12)
        salt = rng.choice([None, None, None, "x"])
        pending.append((prompt[:max(1, capacity - max_new)], max_new, salt))
    while pending or eng.sched.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                eng.add(*pending.pop())
        live = eng.live()
        if live and rng.random() < 0.03:
            eng.abort(rng.choice(live))
        eng.step()
        assert eng.steps < 5000
    for s in eng.seqs:
        assert s.finish_reason == "abort" or len(s.output_ids) == eng.max_new[s]


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_keep_invariants_and_data(seed):
    rng = random.Random(seed)
    caching = seed % 4 != 3
    host = rng.choice([4, 8, 32]) if seed % 4 else 0
    link = rng.choice([0.0, 2.0, float("inf")])   # never, usually, always swap (when the host has room)
    eng = FakeEngine(num_blocks=rng.randrange(12, 40), block_size=rng.choice([1, 2, 4]), budget=rng.choice([8, 32]),
                     max_batch=rng.randrange(1, 8), caching=caching, host_blocks=host, link_bytes_per_flop=link,
                     seed=seed)
    if caching and seed % 3 == 0:
        eng.bm.cache.hash_fn = colliding_hash
    random_workload(eng, rng, 40)
    u = eng.bm.usage()
    assert u["device_blocks_cached"] == eng.bm.allocator.num_cached
    assert eng.bm.allocator.num_used == 0 and (eng.bm.host is None or eng.bm.host.num_used == 0)
    if caching and seed % 3:
        assert u["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("seed", range(12))
def test_random_speculation_keeps_invariants_and_data(seed):
    """Proposals verified with each decoding sequence's last token, partly accepted: the rejected tokens' slots
    are given back, and neither the sequence nor a later prefix-cache hit ever reads their KV."""
    rng = random.Random(2000 + seed)
    caching = seed % 4 != 3
    eng = FakeEngine(num_blocks=rng.randrange(12, 40), block_size=rng.choice([1, 2, 4]), budget=rng.choice([8, 32]),
                     max_batch=rng.randrange(1, 8), caching=caching, host_blocks=rng.choice([0, 8, 32]),
                     link_bytes_per_flop=rng.choice([0.0, float("inf")]), seed=seed, speculate=True)
    random_workload(eng, rng, 30)
    assert eng.accepted > 0 and eng.rejected > 0
    assert eng.bm.allocator.num_used == 0 and (eng.bm.host is None or eng.bm.host.num_used == 0)


@pytest.mark.parametrize("seed", range(12))
def test_random_swapping_under_pressure(seed):
    """Small device pools and an always-swap rule: many preemptions, swaps, and swapped sequences whose
    cached prefix is evicted before they come back (those recompute from what is left)."""
    rng = random.Random(1000 + seed)
    eng = FakeEngine(num_blocks=rng.randrange(8, 12), block_size=rng.choice([2, 4]), budget=rng.choice([8, 32]),
                     max_batch=8, caching=seed % 3 != 0, host_blocks=rng.choice([6, 12, 48]),
                     link_bytes_per_flop=float("inf"), seed=seed)
    random_workload(eng, rng, 30)
    assert eng.sched.num_preemptions > 0
