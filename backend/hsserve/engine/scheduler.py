"""Scheduler: continuous batching policy. Who runs this step, with how many tokens.

Every step: running sequences decode one token each (oldest first; the newest is preempted and
recomputed later when the pool runs dry), prompts in progress take their next chunk, then waiting
sequences are admitted (starting from their longest cached prefix) while there is room in the
batch, the token budget and the KV pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hsserve.engine.block_pool import BlockPool, chain_hash
from hsserve.request import HiddenStatesMode
from hsserve.engine.sequence import Sequence, Status


@dataclass(slots=True)
class Chunk:
    """Compute K/V (and rows) for the tokens at positions start..start + num_tokens - 1 this step
    (seq.token_ids[start:end]; for a chunk queued ahead, the one token is still on the device)."""

    seq: Sequence
    start: int
    num_tokens: int
    # NOTE: queued ahead (engine): before the previous step was read, so its one input token is
    # that step's sample, still on the device (start == seq.num_tokens when queued)
    ahead: bool = False
    last_input: bool = False  # ahead: that token is the sequence's last by length, so no sample

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last known token of the sequence."""
        return self.end == self.seq.num_tokens

    @property
    def samples(self) -> bool:
        if self.ahead:
            return not self.last_input and self.seq.finish_reason is None
        return self.completes and self.seq.finish_reason is None


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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

    def schedule(self, admit: bool = True) -> list[Chunk]:
        """This step's chunks; waiting sequences are admitted only when `admit`."""
        chunks: list[Chunk] = []
        budget = self.max_num_batched_tokens
        running = sorted(self.running, key=lambda s: s.arrival)
        # NOTE: decodes first, oldest first; a victim is always the newest running sequence,
        # so never one already scheduled.
        for seq in running:
            if seq.status is Status.RUNNING and seq.num_uncomputed == 1 and budget:
                if self._reserve(seq):
                    chunks.append(Chunk(seq, seq.num_computed, 1))
                    budget -= 1
        # NOTE: then prompts already started, then new ones: each gets what the budget leaves,
        # so a long prompt is split into chunks and never stalls the decodes above.
        for seq in running:
            if seq.status is Status.RUNNING and seq.num_uncomputed > 1 and budget:
                n = min(seq.num_uncomputed, budget)
                chunks.append(Chunk(seq, seq.num_computed, n))
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
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def _reuses_cache(self, seq: Sequence) -> bool:
        # NOTE: full mode needs every prompt row, so its prompt is computed whatever is cached
        return self.pool.enable_caching and seq.hidden_mode != HiddenStatesMode.FULL

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
        """Drop seq's KV; it goes back to the front of the queue and is recomputed later (its
        cached blocks stay indexed, so the recompute may start from them)."""
        self.pool.free(seq.block_table)
        self._forget_computing(seq)
        seq.block_table = []
        seq.num_computed = seq.num_registered = 0
        seq.last_row = None  # NOTE: the recompute takes it again; a step's rows may sit on the GPU
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
