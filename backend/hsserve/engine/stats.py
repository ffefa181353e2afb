"""EngineStats: counters and latency observations, written by the engine loop, read elsewhere.

The loop only increments integers and appends floats to bounded deques (both safe to read from
another thread in CPython); a metrics thread drains the observations into histograms, off the
hot path.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

_MAX_PENDING = 100_000  # NOTE: observations kept if nobody drains them (bounded memory)


class EngineStats:
    def __init__(self):
        self.prompt_tokens = 0  # per request (n completions share one prompt)
        self.generation_tokens = 0
        self.draft_tokens = 0  # speculative decoding: tokens proposed, and accepted by the target
        self.accepted_tokens = 0
        self.ttft = deque(maxlen=_MAX_PENDING)  # seconds: submit -> first generated token
        self.itl = deque(maxlen=_MAX_PENDING)  # seconds between consecutive tokens of a sequence
        self.latency = deque(maxlen=_MAX_PENDING)  # seconds: submit -> request done

    def snapshot(self, scheduler, pool, graph_captures: int) -> EngineSnapshot:
        """Gauges and running totals now, and the latencies observed since the last snapshot
        (drained: one reader)."""
        return EngineSnapshot(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            blocks_used=pool.num_used, blocks_total=pool.num_blocks, blocks_cached=pool.num_cached,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            query_tokens=pool.num_query_tokens, hit_tokens=pool.num_hit_tokens,
            graph_captures=graph_captures, ttft=self.drain(self.ttft), itl=self.drain(self.itl),
            latency=self.drain(self.latency),
        )

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def drain(observations: deque) -> list[float]:
        out = []
        while True:
            try:
                out.append(observations.popleft())
            except IndexError:
                return out


@dataclass
class EngineSnapshot:
    """What the metrics read from an engine at one refresh (picklable: an engine in a child
    process sends it). The latency lists are the observations since the last snapshot."""

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    blocks_cached: int
    prompt_tokens: int
    generation_tokens: int
    draft_tokens: int
    accepted_tokens: int
    query_tokens: int
    hit_tokens: int
    graph_captures: int
    ttft: list[float]
    itl: list[float]
    latency: list[float]
