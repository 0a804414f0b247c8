"""Randomized workloads through the scheduler and block manager, with invariants after every step."""
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
    held = [b for s in scheduler.running for b in s.block_table]
    assert len(held) == len(set(held)), "two running sequences share a block"
    assert bm.num_blocks - bm.num_free == len(held), "used blocks must be exactly the running sequences' blocks"
    for s in scheduler.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed
    for s in scheduler.waiting:
        assert not s.block_table and s.num_computed == 0
    assert len(scheduler.running) <= scheduler.max_batch_size


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_keeps_invariants_and_finishes_everything(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    bm = BlockManager(num_blocks=rng.randint(40, 120), block_size=block_size)
    capacity = bm.num_blocks * block_size
    scheduler = Scheduler(bm, max_batch_size=rng.randint(4, 32), max_prefill_token_num=rng.randint(32, 256))
    targets, seqs, arrived = {}, [], 0
    total = 300
    steps = 0
    while arrived < total or scheduler.has_unfinished():
        steps += 1
        assert steps < 100_000, "the scheduler stopped making progress"
        for _ in range(min(rng.randint(0, 4), total - arrived)):
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, min(200, capacity // 2)))]
            # Some requests ask for several choices of one prompt (n > 1): their sequences share a group.
            group = f"g{arrived}" if rng.random() < 0.3 else None
            for _ in range(rng.randint(2, 4) if group else 1):
                seq = Sequence(f"r{arrived}", prompt, GenerationConfig(max_new_tokens=50), group=group)
                targets[seq.request_id] = rng.randint(1, min(50, capacity - len(prompt)))
                scheduler.add(seq)
                seqs.append(seq)
                arrived += 1
        batch = scheduler.schedule()
        assert all(s.status is Status.RUNNING for s in batch.seqs), "a preempted sequence left in the step"
        run_batch(scheduler, batch, rng, targets)
        maybe_abort(scheduler, seqs, rng, 0.05)
        check(scheduler, bm)

    assert bm.num_free == bm.num_blocks
    assert all(s.status is Status.FINISHED and s.finish_reason in ("length", "abort") for s in seqs)
    assert len(seqs) == arrived >= total


def test_preemption_recomputes_and_keeps_tokens():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    a = Sequence("a", list(range(8)), GenerationConfig())
    b = Sequence("b", list(range(8)), GenerationConfig())
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert batch.seqs == [a, b]
    for s, n in zip(batch.seqs, batch.num_new):
        s.num_computed += n
        s.output_ids.append(99)
    # Both now need a third block: only the later-admitted one (b) is preempted.
    batch = scheduler.schedule()
    assert batch.seqs == [a] and scheduler.num_preemptions == 1
    assert b.status is Status.WAITING and b.num_computed == 0 and b.output_ids == [99]
    assert scheduler.waiting[0] is b


def test_the_request_running_the_most_choices_yields_blocks_first():
    """A request of three choices (n = 3) and, admitted after it, another client's single stream: when blocks
    run out it is the newest of the three choices that is preempted, not the other client's stream, even when
    that choice was already scheduled in the step."""
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    choices = [Sequence(f"c{i}", list(range(8)), GenerationConfig(), group="job") for i in range(3)]
    alone = Sequence("alone", list(range(8)), GenerationConfig())
    for seq in [*choices, alone]:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.seqs == [*choices, alone] and bm.num_free == 0
    for s, n in zip(batch.seqs, batch.num_new):
        s.num_computed += n
        s.output_ids.append(99)
    # Each now needs a third block and none is free: c0's turn preempts the newest choice, c2, and c1 takes a
    # block that freed; alone's turn preempts the newest choice still running, c1, which leaves the step.
    batch = scheduler.schedule()
    assert batch.seqs == [choices[0], alone] and scheduler.num_preemptions == 2
    assert [s.status for s in choices] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    assert list(scheduler.waiting) == [choices[1], choices[2]]


def test_a_sequences_tokens_are_its_token_ids_sliced():
    seq = Sequence("s", [5, 6, 7], GenerationConfig())
    seq.output_ids = [8, 9]
    for start in range(6):
        for end in range(start, 7):
            assert seq.tokens(start, end) == seq.token_ids[start:end]
