"""Prompt chunks sized by work beside decoding sequences (Scheduler.context_cost): randomized workloads with the
prefix cache (whose hits start a chunk deep in a prompt), with the block manager's invariants after every step
and every step's prompt work within the bound."""
from __future__ import annotations

import random

import pytest

from lmport.config import GenerationConfig
from lmport.kv.block_manager import BlockManager
from lmport.sched.scheduler import Scheduler
from lmport.sched.sequence import Sequence, Status
from support.paging_invariants import check_block_manager
from support.scheduler_workload import maybe_abort, run_batch


def check(scheduler: Scheduler, bm: BlockManager) -> None:
    check_block_manager(bm, [*scheduler.running, *scheduler.waiting])   # ref count = the tables holding a block
    for s in scheduler.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed
    for s in scheduler.waiting:
        assert not s.block_table and s.num_computed == 0


@pytest.mark.parametrize("seed", range(4))
def test_every_step_beside_decodes_keeps_its_prompt_work_within_the_bound(seed):
    rng = random.Random(seed)
    block_size = rng.choice([4, 16])
    bm = BlockManager(num_blocks=rng.randint(60, 160), block_size=block_size, enable_prefix_caching=True)
    capacity = bm.num_blocks * block_size
    bound = rng.choice([8, 32, 64])
    scheduler = Scheduler(bm, max_batch_size=rng.randint(4, 16), max_prefill_token_num=256,
                          decode_prefill_tokens=bound)
    scheduler.context_cost = rng.choice([1e-3, 1e-2, 0.1])
    shared = [rng.randrange(1000) for _ in range(capacity // 4)]   # a prefix many prompts share: cache hits
    targets, seqs, arrived, total, steps = {}, [], 0, 120, 0
    while arrived < total or scheduler.has_unfinished():
        steps += 1
        assert steps < 100_000, "the scheduler stopped making progress"
        for _ in range(min(rng.randint(0, 3), total - arrived)):
            length = rng.randint(1, min(200, capacity // 3))
            prompt = (shared[:length] if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(8)]
            seq = Sequence(f"r{arrived}", prompt, GenerationConfig(max_new_tokens=50))
            targets[seq.request_id] = rng.randint(1, min(50, capacity - len(prompt)))
            scheduler.add(seq)
            seqs.append(seq)
            arrived += 1
        decoding = any(s.num_uncomputed == 1 for s in scheduler.running)
        batch = scheduler.schedule()
        assert all(n >= 1 for n in batch.num_new), batch.num_new
        if decoding:
            chunks = [(s.num_computed, n) for s, n in zip(batch.seqs, batch.num_new) if s.num_uncomputed > 1]
            work = sum(scheduler.prompt_work(start, n, True) for start, n in chunks)
            limit = scheduler.prompt_work(0, bound, True)
            # Beyond the bound only by a chunk of one token: a step's first, or an admitted prompt's whose cache
            # hits start it deeper than the work left reaches.
            over = [(start, n) for start, n in chunks if n == 1]
            assert work <= limit + 1e-6 or (over and work - scheduler.prompt_work(*over[-1], True) <= limit + 1e-6), \
                (chunks, work, limit)
            for s, n in zip(batch.seqs, batch.num_new):   # what the blocks hold is what the chunk computes
                assert len(s.block_table) == bm.blocks_for(s.num_computed + n)
        run_batch(scheduler, batch, rng, targets)
        maybe_abort(scheduler, seqs, rng, 0.05)
        check(scheduler, bm)
    assert all(s.status is Status.FINISHED for s in seqs)
