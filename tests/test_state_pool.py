"""The recurrent-state pool (lmport.kv.state_pool): on random workloads no slot leaks and no slot is held by two
sequences, whether the pool is driven directly or by the scheduler (admission, finish, abort, preemption by
recompute); its bytes are what the model config says a sequence's state takes."""
from __future__ import annotations

import random

import pytest
import torch

from lmport.config import GenerationConfig
from lmport.kv.block_manager import BlockManager
from lmport.kv.state_pool import NoFreeStateSlot, RecurrentStateSpec, StatePool, StateTensors
from lmport.sched.scheduler import Scheduler
from lmport.sched.sequence import Sequence, Status
from support.paging_invariants import check_block_manager
from support.scheduler_workload import maybe_abort, run_batch


@pytest.mark.parametrize("seed", range(5))
def test_random_allocate_and_free_never_leaks_or_shares_a_slot(seed):
    rng = random.Random(seed)
    pool, held = StatePool(rng.randint(1, 8)), {}
    for step in range(500):
        if rng.random() < 0.55:
            seq = f"s{step}"
            if pool.can_allocate():
                held[seq] = pool.allocate(seq)
            else:
                with pytest.raises(NoFreeStateSlot):
                    pool.allocate(seq)
        elif held:
            seq = rng.choice(sorted(held))
            pool.free(seq)
            del held[seq]
        pool.check_invariants()
        assert len(set(held.values())) == len(held)
        assert pool.num_free == pool.num_slots - len(held)
        assert {s: pool.slot_of(s) for s in held} == held
    for seq in list(held):
        pool.free(seq)
    pool.check_invariants()
    assert pool.num_free == pool.num_slots


def test_a_sequence_holds_one_slot_and_a_second_free_is_harmless():
    pool = StatePool(2)
    slot = pool.allocate("a")
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate("a")
    pool.free("a")
    pool.free("a")
    pool.free("never-admitted")
    pool.check_invariants()
    assert pool.allocate("b") in (0, 1) and pool.num_free == 1 and slot in (0, 1)


def test_invariants_catch_a_shared_or_leaked_slot():
    pool = StatePool(3)
    pool.allocate("a")
    pool.holders["b"] = pool.holders["a"]   # two sequences in one slot
    with pytest.raises(AssertionError, match="two sequences"):
        pool.check_invariants()
    pool = StatePool(3)
    pool.free_slots.pop()                    # a slot neither free nor held
    with pytest.raises(AssertionError, match="leaked"):
        pool.check_invariants()


def test_bytes_per_sequence_is_the_tensors_bytes():
    spec = RecurrentStateSpec(num_layers=3, conv_channels=24, conv_width=3, num_heads=4, key_dim=16, value_dim=8,
                              conv_dtype=torch.bfloat16)
    assert spec.bytes_per_sequence == 3 * (24 * 3 * 2 + 4 * 16 * 8 * 4)
    tensors = StateTensors(spec, num_slots=5, device="cpu")
    assert tensors.bytes == 5 * spec.bytes_per_sequence


def check_slots(scheduler: Scheduler, pool: StatePool, seqs: list[Sequence]) -> None:
    """Running sequences hold one slot each (the one the pool records), every other sequence none."""
    pool.check_invariants()
    for s in seqs:
        if s.status is Status.RUNNING:
            assert pool.holds(s) and s.state_slot == pool.slot_of(s), s.request_id
        else:
            assert not pool.holds(s) and s.state_slot == -1, s.request_id
    assert pool.num_free == pool.num_slots - len(scheduler.running)


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_workload_allocates_on_admission_and_frees_on_every_end(seed):
    rng = random.Random(seed)
    max_batch = rng.randint(2, 5)
    bm = BlockManager(num_blocks=rng.randint(8, 12), block_size=4)   # too few for max_batch long sequences
    scheduler = Scheduler(bm, max_batch_size=max_batch, max_prefill_token_num=rng.randint(4, 32))
    pool = scheduler.state_pool = StatePool(max_batch)
    seqs, targets = [], {}
    for i in range(30):
        seq = Sequence(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, 20))],
                       GenerationConfig(max_new_tokens=8))
        seqs.append(seq)
        targets[seq.request_id] = rng.randint(1, 8)
        scheduler.add(seq)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        batch = scheduler.schedule()
        check_slots(scheduler, pool, seqs)
        check_block_manager(bm, [s for s in seqs if s.status is Status.RUNNING])
        run_batch(scheduler, batch, rng, targets)
        maybe_abort(scheduler, seqs, rng, 0.05)
        check_slots(scheduler, pool, seqs)
    assert not scheduler.has_unfinished()
    assert pool.num_free == pool.num_slots
    assert scheduler.num_preemptions > 0   # preemption by recompute gave slots back mid-sequence
