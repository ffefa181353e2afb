"""EngineClient: what a front end (the Triton adapter, the CLI, tests) holds of an engine, whether
its loop is a thread of this process (loop.Engine) or a child process (process.EngineProcess)."""

from __future__ import annotations

from typing import Callable, Protocol

from hsserve.engine.engine_info import EngineInfo
from hsserve.engine.stats import EngineSnapshot
from hsserve.request import Delta, GenerationRequest

Sink = Callable[[Delta], None]


class EngineClient(Protocol):
    info: EngineInfo  # set by start()
    error: BaseException | None  # why it is not serving, when it died or failed to load

    def start(self) -> EngineClient:
        """Load the model and start serving; re-raises a load error."""

    def submit(self, request: GenerationRequest, sink: Sink | None = None) -> Sink:
        """Admit and enqueue: RequestError names a bad input, EngineUnavailable when the queue
        is full or the engine is not serving. The request's deltas go to `sink` (a
        RequestStream when none is given), which is returned."""

    def abort(self, request_id: str) -> None:
        """Cancel a request: each completion ends with finish_reason 'cancelled'."""

    def abort_all(self, message: str) -> None:
        """End every request in flight with an error delta carrying `message`."""

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks held by running requests stay held)."""

    def snapshot(self) -> EngineSnapshot | None:
        """Gauges, totals and the latencies observed since the last snapshot (one reader)."""

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop; requests still in flight end with an error delta."""

    @property
    def healthy(self) -> bool:
        """Serving: started, not stopped, not dead."""

    @property
    def died(self) -> bool:
        """It stopped without being asked to (the reason is in `error`)."""
