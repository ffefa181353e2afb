"""Allocator and scheduling policy with fake sequences (no model)."""

from __future__ import annotations

import pytest

from hsserve.block_pool import BlockPool
from hsserve.request import HiddenStatesMode, SamplingParams
from hsserve.scheduler import Scheduler
from hsserve.sequence import Sequence, Status


def seq(i: int, n: int) -> Sequence:
    return Sequence(f"s{i}", list(range(n)), SamplingParams(), 0, HiddenStatesMode.NONE, (), None,
                    None, arrival=i)


def test_pool_allocate_free_and_invariants():
    pool = BlockPool(8, 4)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2
    a = pool.allocate(3)
    assert pool.can_allocate(5) and not pool.can_allocate(6)
    pool.check_invariants()
    pool.free(a)
    assert pool.num_free == 8
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError):
        pool.allocate(9)


def test_scheduler_admits_within_limits_and_batches_decode_with_prefill():
    pool = BlockPool(10, 4)
    s = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64)
    a, b, c = seq(1, 6), seq(2, 9), seq(3, 3)
    for x in (a, b, c):
        s.add(x)
    chunks = s.schedule()
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(a, 0, 6), (b, 0, 9)]
    assert c.status is Status.WAITING  # max_num_seqs
    for ch in chunks:  # pretend the step ran and sampled one token each
        ch.seq.num_computed = ch.end
        ch.seq.token_ids.append(7)
    s.finish(a)
    chunks = s.schedule()
    assert [(ch.seq, ch.num_tokens) for ch in chunks] == [(b, 1), (c, 3)]
    assert pool.num_used == len(b.block_table) + len(c.block_table)


def test_scheduler_preempts_newest_when_pool_runs_dry():
    pool = BlockPool(4, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(1, 8), seq(2, 8)
    s.add(a)
    s.add(b)
    s.schedule()
    for x in (a, b):
        x.num_computed = 8
        x.token_ids.append(1)
    chunks = s.schedule()  # both need a third block; only `a` (older) can get one
    assert [ch.seq for ch in chunks] == [a]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert s.num_preemptions == 1
    pool.check_invariants()


def test_long_prompt_runs_alone_instead_of_starving():
    pool = BlockPool(100, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16)
    big, small = seq(1, 40), seq(2, 4)
    s.add(big)
    s.add(small)
    chunks = s.schedule()
    assert [ch.seq for ch in chunks] == [big]
