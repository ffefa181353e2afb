"""EngineStats: counters and latency observations, written by the engine loop, read elsewhere.

The loop only increments integers and appends floats to bounded deques (both safe to read from
another thread in CPython); a metrics thread drains the observations into histograms, off the
hot path.
"""

from __future__ import annotations

import time
from collections import deque

_MAX_PENDING = 100_000  # NOTE: observations kept if nobody drains them (bounded memory)


class EngineStats:
    def __init__(self):
        self.prompt_tokens = 0  # per request (n completions share one prompt)
        self.generation_tokens = 0
        self.ttft = deque(maxlen=_MAX_PENDING)  # seconds: submit -> first generated token
        self.itl = deque(maxlen=_MAX_PENDING)  # seconds between consecutive tokens of a sequence
        self.latency = deque(maxlen=_MAX_PENDING)  # seconds: submit -> request done

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
