"""Scheduler: continuous batching policy. Who runs this step, with how many tokens.

Every step: running sequences decode one token each (oldest first; the newest is preempted and
recomputed later when the pool runs dry), prompts in progress take their next chunk, then waiting
sequences are admitted (starting from their longest cached prefix) while there is room in the
batch, the token budget and the KV pool. With async scheduling the next decode step may be
planned before the last one is read (schedule_ahead). All KV blocks are allocated here.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from hsserve.engine.block_pool import BlockPool, chain_hash
from hsserve.engine.hidden_rows import covers_every_prompt_row, wants_final_row
from hsserve.engine.sequence import Sequence, Status
from hsserve.engine.speculative import Eagle3Proposer, NgramProposer
from hsserve.engine.types import Chunk


def prefill_chunk(seq: Sequence, n: int) -> Chunk:
    """seq's next n uncomputed tokens; with the prompt positions among them whose logits give
    prompt logprobs not yet recorded (a recompute after preemption records none twice)."""
    start = seq.num_computed
    span = None
    if seq.prompt_logprobs is not None:
        lo, hi = max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
        span = (lo, hi, seq.sampling.prompt_logprobs) if hi > lo else None
    return Chunk(seq, start, n, prompt_span=span)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_wait_ms: float = 0.0,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 proposer: NgramProposer | Eagle3Proposer | None = None):
        self.pool = pool
        self.proposer = proposer  # NOTE: speculative decoding: drafts for the decodes
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_wait_s = prefill_wait_ms / 1000
        self._on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # NOTE: prefix blocks being computed now, by whom: a prompt with the same prefix waits
        # for them instead of computing them a second time (a burst sharing a system prompt;
        # the n completions of one request).
        self._computing: dict[bytes, Sequence] = {}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def admit_now(self) -> bool:
        """Admit waiting prompts this step: at once when nothing runs, when they fill the free
        slots, or when the oldest has waited prefill_wait_ms; until then decoding goes on, so
        that prompts arriving close together prefill in one step."""
        free = self.max_num_seqs - len(self.running)
        if not self.waiting or free <= 0:
            return False
        if not self.prefill_wait_s or not self.running or len(self.waiting) >= free:
            return True
        return time.monotonic() - self.waiting[0].t_submit >= self.prefill_wait_s

    def schedule_ahead(self, prev: list[Chunk], sampled: list[bool]) -> list[Chunk] | None:
        """The decode step after `prev` for the sequences it sampled, queued before prev is read
        (their input tokens are prev's samples, on the device); None when the scheduler must see
        prev's tokens first (a prompt in progress, prompts to admit, the pool dry, drafts to
        propose: they follow prev's tokens)."""
        if self.proposer is not None:
            return None
        if not all(f or (c.ahead and c.last_input) for c, f in zip(prev, sampled)):
            return None
        if self.admit_now():
            return None
        chunks, grow = [], []
        bs = self.pool.block_size
        for c in prev:
            seq = c.seq
            if seq.status is not Status.RUNNING or seq.finish_reason is not None:
                continue  # NOTE: cancelled, or its end decided (only a row-only step is left)
            last = seq.ends_at(seq.num_tokens + 1)  # NOTE: with prev's sample, not read yet
            if last and not wants_final_row(seq):
                continue
            # NOTE: a row-only chunk ends its sequence, the others go on ahead (bench/README.md#async-scheduling)
            chunks.append(Chunk(seq, c.end, 1, ahead=True, last_input=last))
            if len(seq.block_table) * bs <= c.end:  # NOTE: its blocks hold positions < c.end
                grow.append(seq)
        if not chunks or not self.pool.can_allocate(len(grow)):
            return None  # NOTE: schedule() preempts when the pool runs dry
        for seq in grow:
            seq.block_table += self.pool.allocate(1)
        return chunks

    def schedule(self) -> list[Chunk]:
        """This step's chunks; waiting sequences are admitted when admit_now()."""
        admit = self.admit_now()
        chunks: list[Chunk] = []
        budget = self.max_num_batched_tokens
        running = sorted(self.running, key=lambda s: s.arrival)
        # NOTE: decodes first, oldest first; a victim is always the newest running sequence,
        # so never one already scheduled.
        # NOTE: drafts take only what is left once every decode has its one token
        spare = budget - sum(s.num_uncomputed == 1 for s in running)
        for seq in running:
            if seq.status is Status.RUNNING and seq.num_uncomputed == 1 and budget:
                draft = self._draft(seq, spare)
                if self._reserve(seq, len(draft)):
                    self._lookahead(seq, len(draft))
                    chunks.append(Chunk(seq, seq.num_computed, 1 + len(draft), draft=draft))
                    budget -= 1 + len(draft)
                    spare -= len(draft)
        # NOTE: then prompts already started, then new ones: each gets what the budget leaves,
        # so a long prompt is split into chunks and never stalls the decodes above.
        for seq in running:
            if seq.status is Status.RUNNING and seq.num_uncomputed > 1 and budget:
                n = min(seq.num_uncomputed, budget)
                chunks.append(prefill_chunk(seq, n))
                budget -= n
        for seq in list(self.waiting) if admit else ():
            if not budget or len(self.running) >= self.max_num_seqs:
                break
            hashes = self._usable_hashes(seq)
            hits = self.pool.match(hashes)
            if self._prefix_in_flight(seq, hashes, len(hits)):
                continue
            if not self._admit(seq, hashes, hits):
                break
            n = min(seq.num_uncomputed, budget)
            chunks.append(prefill_chunk(seq, n))
            budget -= n
        return chunks

    def _reuses_cache(self, seq: Sequence) -> bool:
        # NOTE: prompt logprobs need every prompt position's logits: none may come from the cache
        return (self.pool.enable_caching and not covers_every_prompt_row(seq)
                and seq.sampling.prompt_logprobs is None)

    def _usable_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the blocks seq may take from the cache. NOTE: the last token is always
        computed: it gives the logits (and the last row), and a shared block is never written."""
        if not self._reuses_cache(seq):
            return []
        usable = (seq.num_tokens - 1) // self.pool.block_size
        self._hash_blocks(seq, usable)
        return seq.block_hashes[:usable]

    def _prefix_in_flight(self, seq: Sequence, hashes: list[bytes], num_hits: int) -> bool:
        """True when the first block seq misses in the cache is being computed by another."""
        return num_hits < len(hashes) and self._computing.get(hashes[num_hits], seq) is not seq

    def _admit(self, seq: Sequence, hashes: list[bytes], hits: list[int]) -> bool:
        """Give a waiting sequence its cached prefix `hits` (blocks of `hashes`) and fresh blocks
        for the rest, if they fit."""
        bs = self.pool.block_size
        fresh = seq.num_cached_tokens is None  # NOTE: first admission, not a recompute
        need = self.pool.blocks_for(seq.num_tokens) - len(hits)
        if need > self.pool.num_free - self.pool.num_free_among(hits):
            return False
        self.pool.acquire(hits)
        seq.block_table = hits + self.pool.allocate(need)
        seq.num_computed = seq.num_registered = len(hits) * bs
        for h in hashes[len(hits) :]:
            self._computing.setdefault(h, seq)
        if fresh:
            seq.num_cached_tokens = len(hits) * bs
            self.pool.num_query_tokens += seq.num_prompt_tokens
            self.pool.num_hit_tokens += len(hits) * bs
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.pool.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else b"", seq.token_ids[i * bs : (i + 1) * bs]))

    def cache_computed(self, seq: Sequence) -> None:
        """Index seq's blocks that became full and computed (prompt and generated alike)."""
        if not self.pool.enable_caching or seq.status is not Status.RUNNING:
            return
        bs = self.pool.block_size
        full = seq.num_computed // bs
        if full * bs <= seq.num_registered:
            return
        self._hash_blocks(seq, full)
        for i in range(seq.num_registered // bs, full):
            self.pool.register(seq.block_table[i], seq.block_hashes[i])
            if self._computing.get(seq.block_hashes[i]) is seq:
                del self._computing[seq.block_hashes[i]]
        seq.num_registered = full * bs

    def _forget_computing(self, seq: Sequence) -> None:
        for h in seq.block_hashes:
            if self._computing.get(h) is seq:
                del self._computing[h]

    def _draft(self, seq: Sequence, spare: int) -> tuple[int, ...]:
        """Tokens proposed to follow seq's last (none for a row-only chunk), no more than the
        budget's spare tokens or than would take it past its length limit with the target's."""
        if self.proposer is None or seq.finish_reason is not None or seq.grammar is not None:
            return ()
        return self.proposer.propose_for(seq, min(spare, seq.max_num_tokens - seq.num_tokens - 1))

    def _lookahead(self, seq: Sequence, extra: int) -> None:
        """The slots the proposer writes past a draft's (EAGLE-3's head), where they are free:
        never a preemption for them (the head drafts less at a block it lacks)."""
        ahead = self.proposer.lookahead if self.proposer is not None else 0
        need = self.pool.blocks_for(seq.num_tokens + extra + ahead) - len(seq.block_table)
        if ahead and need > 0 and self.pool.can_allocate(need):
            seq.block_table += self.pool.allocate(need)

    def _reserve(self, seq: Sequence, extra: int = 0) -> bool:
        """Make sure seq has blocks for all its tokens and `extra` after them (a draft's),
        preempting newer sequences if needed."""
        need = max(0, self.pool.blocks_for(seq.num_tokens + extra) - len(seq.block_table))
        while not self.pool.can_allocate(need):
            victim = max(
                (s for s in self.running if s.status is Status.RUNNING), key=lambda s: s.arrival
            )
            self.preempt(victim)
            if victim is seq:
                return False
        seq.block_table += self.pool.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop seq's KV; it goes back to the front of the queue and is recomputed later (its
        cached blocks stay indexed, so the recompute may start from them)."""
        self.pool.free(seq.block_table)
        self._forget_computing(seq)
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0
        if self._on_preempt is not None:
            self._on_preempt(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.free(seq.block_table)
        self._forget_computing(seq)
        seq.block_table = []
        seq.status = Status.FINISHED
