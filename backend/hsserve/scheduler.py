"""Scheduler: continuous batching policy. Who runs this step, with how many tokens.

Every step: running sequences decode one token each (oldest first; the newest is preempted and
recomputed later when the pool runs dry), then waiting sequences are admitted while there is
room in the batch, the token budget and the KV pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hsserve.block_pool import BlockPool
from hsserve.sequence import Sequence, Status


@dataclass
class Chunk:
    """Compute K/V (and rows) for seq.token_ids[start:start + num_tokens] this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last known token of the sequence."""
        return self.end == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        return self.completes and self.seq.finish_reason is None


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.max_num_batched_tokens
        # NOTE: oldest first; a victim is always the newest, so never one already scheduled.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if not self._reserve(seq):
                continue
            chunks.append(Chunk(seq, seq.num_computed, seq.num_uncomputed))
            budget -= seq.num_uncomputed
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed
            if n > budget and chunks:  # NOTE: a prompt over the budget runs alone, never starves
                break
            need = self.pool.blocks_for(seq.num_tokens) - len(seq.block_table)
            if not self.pool.can_allocate(need):
                break
            self.waiting.popleft()
            seq.block_table += self.pool.allocate(need)
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def _reserve(self, seq: Sequence) -> bool:
        """Make sure seq has blocks for all its tokens, preempting newer sequences if needed."""
        need = self.pool.blocks_for(seq.num_tokens) - len(seq.block_table)
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
        """Drop seq's KV; it goes back to the front of the queue and is recomputed later."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
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
        seq.block_table = []
        seq.status = Status.FINISHED
