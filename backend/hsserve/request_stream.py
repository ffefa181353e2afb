"""RequestStream: a thread-safe sink for one request's deltas, and their collected result."""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from hsserve.request import Delta, FinishReason


@dataclass
class Result:
    request_id: str
    token_ids: list[int]
    text: str
    hidden: torch.Tensor | None
    finish_reason: FinishReason | None
    num_input_tokens: int
    num_output_tokens: int
    error: str | None
    num_deltas: int


class RequestStream:
    """Pass as the sink of Engine.submit; iterate it (or call result()) in the client's thread."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()

    def __call__(self, delta: Delta) -> None:  # NOTE: called on the engine thread; never blocks
        self._queue.put(delta)

    def __iter__(self):
        while True:
            delta = self._queue.get()
            yield delta
            if delta.finished:
                return

    def result(self, timeout: float | None = None) -> Result:
        deltas = []
        while not deltas or not deltas[-1].finished:
            deltas.append(self._queue.get(timeout=timeout))
        d = Delta.merge(deltas)
        return Result(
            request_id=self.request_id,
            token_ids=d.token_ids,
            text=d.text,
            hidden=d.hidden,
            finish_reason=d.finish_reason,
            num_input_tokens=d.num_input_tokens,
            num_output_tokens=d.num_output_tokens,
            error=d.error,
            num_deltas=len(deltas),
        )
