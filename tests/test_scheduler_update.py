"""Scheduler.update_from_output: the scheduler advances its sequences from the worker's output (token ids), ends
them (stop token, max_new_tokens, session_len, a failure) and frees their blocks, with no model."""
from __future__ import annotations

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, Failure, FinishReason
from lmport.kv.block_manager import BlockManager
from lmport.sched.output import ModelOutput, SequenceOutput
from lmport.sched.scheduler import Scheduler
from lmport.sched.sequence import Sequence

EOS = 2


def _scheduler(session_len: int = 64) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    scheduler.session_len = session_len
    return scheduler, bm


def _seq(name: str, prompt_len: int = 5, max_new_tokens: int = 8) -> Sequence:
    return Sequence(name, list(range(10, 10 + prompt_len)), GenerationConfig(max_new_tokens=max_new_tokens),
                    frozenset({EOS}))


def _step(scheduler: Scheduler, tokens: dict[str, list[int]], failures: dict[str, Failure] | None = None):
    batch = scheduler.schedule()
    output = ModelOutput({s: SequenceOutput(tokens.get(s.request_id, []), [None] * len(tokens.get(s.request_id, [])),
                                            failure=(failures or {}).get(s.request_id))
                          for s in batch.seqs})
    return batch, scheduler.update_from_output(batch, output)


def test_tokens_are_appended_and_computed_and_a_stop_token_frees_the_blocks():
    scheduler, bm = _scheduler()
    a, b = _seq("a"), _seq("b")
    scheduler.add(a)
    scheduler.add(b)
    batch, updates = _step(scheduler, {"a": [7], "b": [8]})
    assert [(u.seq.request_id, u.token_ids) for u in updates] == [("a", [7]), ("b", [8])]
    assert a.num_computed == 5 and a.output_ids == [7] and a.num_uncomputed == 1
    _, updates = _step(scheduler, {"a": [EOS], "b": [9]})
    assert a.is_finished and a.finish_reason is FinishReason.STOP and a not in scheduler.running
    assert not b.is_finished and b.output_ids == [8, 9]
    assert bm.num_free == bm.num_blocks - len(b.block_table)   # only b holds blocks


def test_max_new_tokens_and_session_len_end_with_length():
    scheduler, bm = _scheduler(session_len=7)
    short, long_ = _seq("short", max_new_tokens=1), _seq("long", max_new_tokens=50)
    scheduler.add(short)
    scheduler.add(long_)
    _, updates = _step(scheduler, {"short": [7], "long": [7]})
    assert short.finish_reason is FinishReason.LENGTH and not long_.is_finished
    _, updates = _step(scheduler, {"long": [8]})   # 5 prompt + 2 generated = session_len
    assert long_.finish_reason is FinishReason.LENGTH and [u.seq for u in updates] == [long_]
    assert bm.num_free == bm.num_blocks and not scheduler.has_unfinished()


def test_a_failure_ends_only_its_request_and_keeps_its_kind():
    scheduler, bm = _scheduler()
    good, bad = _seq("good"), _seq("bad")
    scheduler.add(good)
    scheduler.add(bad)
    fault = Failure("response_format: dead end", ErrorKind.REQUEST)
    _, updates = _step(scheduler, {"good": [7]}, {"bad": fault})
    assert bad.finish_reason is FinishReason.ERROR and (bad.error, bad.error_kind) == (fault.message, fault.kind)
    assert not good.is_finished and scheduler.running == [good]
    assert {u.seq.request_id: u.token_ids for u in updates} == {"good": [7], "bad": []}


def test_tokens_after_the_one_that_ends_the_request_are_dropped():
    scheduler, _ = _scheduler()
    seq = _seq("a")
    scheduler.add(seq)
    _, updates = _step(scheduler, {"a": [7, EOS, 9]})   # as a verified proposal's tokens come
    assert seq.output_ids == [7, EOS] and updates[0].token_ids == [7, EOS] and seq.finish_reason == "stop"


def test_a_failed_forward_ends_the_batch_and_computes_nothing():
    scheduler, bm = _scheduler()
    seqs = [_seq("a"), _seq("b")]
    for s in seqs:
        scheduler.add(s)
    batch = scheduler.schedule()
    updates = scheduler.update_from_output(batch, ModelOutput(failure=Failure("forward failed: boom")))
    assert [u.seq for u in updates] == seqs and all(s.error == "forward failed: boom" for s in seqs)
    assert all(s.error_kind is ErrorKind.ENGINE and s.num_computed == 0 for s in seqs)
    assert bm.num_free == bm.num_blocks
