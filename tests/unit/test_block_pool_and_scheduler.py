"""Block pool and scheduler: allocation, prefix reuse, chunking and preemption keep the invariants.

Allocator and scheduling policy with fake sequences (no model)."""

from __future__ import annotations

import pytest

from hsserve.engine.block_pool import BlockPool, chain_hash
from hsserve.request import HiddenStatesMode, SamplingParams
from hsserve.engine.scheduler import Scheduler
from hsserve.engine.sequence import Sequence, Status


def seq(i: int, n: int, first_token: int | None = None) -> Sequence:
    """A fake sequence; prompts of different i share no prefix unless first_token is given."""
    start = 100 * i if first_token is None else first_token
    return Sequence(f"s{i}", list(range(start, start + n)), SamplingParams(), 0,
                    HiddenStatesMode.NONE, (), None, None, arrival=i, max_num_tokens=n + 16)


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


def run_step(chunks, token=7):
    """Pretend the step ran: K/V computed, one token sampled where the chunk completes."""
    for ch in chunks:
        ch.seq.num_computed = ch.end
        if ch.completes:
            ch.seq.token_ids.append(token)


def test_long_prompt_is_chunked_and_never_stalls_decodes():
    pool = BlockPool(100, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=16)
    old, big, small = seq(1, 5), seq(2, 40), seq(3, 4)
    s.add(old)
    run_step(s.schedule())
    s.add(big)
    s.add(small)
    steps = []
    for _ in range(4):
        chunks = s.schedule()
        steps.append([(ch.seq, ch.start, ch.num_tokens) for ch in chunks])
        run_step(chunks)
    assert steps[0] == [(old, 5, 1), (big, 0, 15)]
    assert steps[1] == [(old, 6, 1), (big, 15, 15)]
    assert steps[2] == [(old, 7, 1), (big, 30, 10), (small, 0, 4)]
    assert steps[3] == [(old, 8, 1), (big, 40, 1), (small, 4, 1)]


def test_pool_prefix_index_revives_evicts_lru_and_clears():
    pool = BlockPool(4, 4)
    h = [chain_hash(b"", [1, 2, 3, 4])]
    h.append(chain_hash(h[0], [5, 6, 7, 8]))
    assert chain_hash(b"", [1, 2, 3, 5]) != h[0] and chain_hash(h[1], [1, 2, 3, 4]) != h[0]
    a = pool.allocate(2)
    pool.register(a[0], h[0])
    pool.register(a[1], h[1])
    assert pool.match(h) == a and pool.num_cached == 2
    pool.free(a)  # free but still indexed
    assert pool.num_free == 4 and pool.match(h) == a
    pool.acquire(pool.match(h[:1]))  # a hit revives the block
    assert pool.num_free == 3
    pool.free(a[:1])
    # LRU: the never-used blocks go first, then a[1] (freed before a[0] was freed again)
    got = pool.allocate(3)
    assert a[0] not in got and a[1] in got
    assert pool.match(h) == [a[0]] and pool.num_evictions == 1
    pool.check_invariants()
    pool.free(got)
    pool.clear_cache()
    assert pool.match(h) == [] and pool.num_free == 4 and pool.num_cached == 0
    pool.check_invariants()


def test_scheduler_starts_from_the_cached_prefix_but_computes_the_last_token():
    pool = BlockPool(20, 4)
    s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    first = seq(1, 12, first_token=0)
    s.add(first)
    run_step(s.schedule())
    s.cache_computed(first)
    s.finish(first)
    again, longer = seq(2, 12, 0), seq(3, 14, 0)  # same 12 tokens (a complete hit); 12 + 2 more
    s.add(again)
    s.add(longer)
    chunks = s.schedule()
    # the complete hit reuses 2 of 3 blocks (its last token is computed); `longer` all 3
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(again, 8, 4), (longer, 12, 2)]
    assert again.block_table[:2] == longer.block_table[:2]
    assert pool.num_hit_tokens == 8 + 12 and pool.num_query_tokens == 12 + 12 + 14
    pool.check_invariants()


def test_full_mode_and_disabled_cache_compute_every_token():
    for enable, mode in ((False, HiddenStatesMode.NONE), (True, HiddenStatesMode.FULL)):
        pool = BlockPool(20, 4, enable_caching=enable)
        s = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
        a = seq(1, 12, 0)
        s.add(a)
        run_step(s.schedule())
        s.cache_computed(a)
        b = seq(2, 12, 0)
        b.hidden_mode = mode
        s.add(b)
        assert [(ch.start, ch.num_tokens) for ch in s.schedule()] == [(12, 1), (0, 12)]


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    pool = BlockPool(40, 4)
    s = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = seq(1, 18, 0), seq(2, 18, 0), seq(3, 5)  # a and b share 4 full blocks
    for x in (a, b, c):
        s.add(x)
    chunks = s.schedule()
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(a, 0, 18), (c, 0, 5)]
    run_step(chunks)
    for x in (a, c):
        s.cache_computed(x)
    chunks = s.schedule()  # b now takes a's 4 blocks and computes its last 2 tokens
    assert [(ch.seq, ch.start, ch.num_tokens) for ch in chunks] == [(a, 18, 1), (c, 5, 1), (b, 16, 2)]
    assert b.block_table[:4] == a.block_table[:4]
    s.preempt(a)  # an abandoned prefix is not waited for
    d = seq(4, 30, 500)
    e = seq(5, 30, 500)
    s.add(d)
    s.add(e)
    s.finish(b)
    s.finish(c)
    chunks = s.schedule()
    assert d in [ch.seq for ch in chunks] and e not in [ch.seq for ch in chunks]
    s.finish(d)  # d leaves before computing: e no longer waits
    assert e in [ch.seq for ch in s.schedule()]
    pool.check_invariants()
