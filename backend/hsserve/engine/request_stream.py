"""RequestStream: a thread-safe sink for one request's deltas, and their collected result."""

from __future__ import annotations

import queue
from dataclasses import dataclass, fields

import torch

from hsserve.request import Delta, FinishReason, TokenLogprob


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
    sequence_index: int = 0
    logprobs: list[TokenLogprob] | None = None  # per token, when asked for
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, the first None


class RequestStream:
    """Pass as the sink of Engine.submit; iterate it (or call result()) in the client's thread."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self._results: list[Result] | None = None  # NOTE: once collected, asked again: the same
        self._taken: dict[int, list[Delta]] = {}  # NOTE: deltas taken by a call that timed out

    def __call__(self, delta: Delta) -> None:  # NOTE: called on the engine thread; never blocks
        self._queue.put(delta)

    def __iter__(self):
        """Deltas as they come (the n completions of a request interleaved) until the last."""
        while True:
            delta = self._queue.get()
            yield delta
            if delta.request_done:
                return

    def results(self, timeout: float | None = None) -> list[Result]:
        """Every completion's collected result, by sequence_index (a second call returns the same;
        do not mix with iterating the stream)."""
        if self._results is not None:
            return self._results
        by_index = self._taken  # NOTE: a call that timed out keeps what it took for the next
        while True:
            delta = self._queue.get(timeout=timeout)
            by_index.setdefault(delta.sequence_index, []).append(delta)
            if delta.request_done:
                break
        self._results = [_collect(self.request_id, by_index[i]) for i in sorted(by_index)]
        return self._results

    def result(self, timeout: float | None = None) -> Result:
        """The collected result of a request with one completion (n = 1)."""
        results = self.results(timeout)
        if len(results) != 1:
            raise ValueError(f"{len(results)} completions; use results()")
        return results[0]


def _collect(request_id: str, deltas: list[Delta]) -> Result:
    d = Delta.merge(deltas)
    same = {f.name: getattr(d, f.name) for f in fields(Result) if hasattr(d, f.name)}
    return Result(**{**same, "request_id": request_id, "num_deltas": len(deltas)})
