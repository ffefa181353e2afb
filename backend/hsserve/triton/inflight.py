"""The requests the adapter has submitted and not yet ended, and how each one's deltas become
responses: streamed as they come, or gathered per completion and sent once when not streamed."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from hsserve.request import Delta, FinishReason
from hsserve.triton.responses import ALL_OUTPUTS, Responses

_ENDS_REQUEST = (FinishReason.CANCELLED, FinishReason.ERROR)


@dataclass
class Inflight:
    sender: object  # the request's Triton response sender
    stream: bool = False
    outputs: frozenset = ALL_OUTPUTS  # NOTE: only these are built
    deltas: dict[int, list[Delta]] = field(default_factory=dict)  # not streamed: per completion
    next_cancel_check: float = 0.0
    echo: str = ""  # not streamed: the prompt text each completion's text_output starts with
    returns: frozenset = frozenset()  # vllm_backend's return_* outputs asked for
    interval: int = 1  # streamed: tokens a response (stream_interval)
    # NOTE: once the final response is sent Triton frees the request, and asking its sender
    # is_cancelled() then crashes tritonserver (seen: SIGSEGV in
    # TRITONBACKEND_ResponseFactoryIsCancelled): the final send and every is_cancelled() hold
    # this lock, and nothing is asked after `finished`
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False

    def send(self, response, final: bool, final_flag: int) -> None:
        """Send unless the final response has gone (then the request is Triton's no more)."""
        with self.lock:
            if not self.finished:
                self.finished = final
                self.sender.send(response, flags=final_flag if final else 0)

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.finished and self.sender.is_cancelled()


class InflightRequests:
    def __init__(self, responses: Responses, abort: Callable[[str], None], warn: Callable[[str], None]):
        """abort(request_id): cancels it in the engine (its client is gone); warn: the logger's."""
        self.responses, self._abort, self._warn = responses, abort, warn
        self._final_flag = responses.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._states: dict[str, Inflight] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self.shutting_down = False  # NOTE: errors then answer UNAVAILABLE, not INTERNAL

    def new_id(self, triton_id: str) -> str:
        """Triton's request id is optional and need not be unique: ours adds a counter."""
        with self._lock:
            self._counter += 1
            return f"{triton_id or 'req'}#{self._counter}"

    def add(self, rid: str, state: Inflight) -> None:
        with self._lock:
            self._states[rid] = state

    def forget(self, rid: str) -> Inflight | None:
        with self._lock:
            return self._states.pop(rid, None)

    def __len__(self) -> int:
        return len(self._states)

    def stream_interval(self, rid: str) -> int:
        """The request's stream_interval (1 once it is forgotten, or not streamed)."""
        state = self._states.get(rid)  # NOTE: one dict read, no lock: the sender asks each round
        return state.interval if state is not None and state.stream else 1

    def num_streams(self) -> int:
        return sum(1 for st in list(self._states.values()) if st.stream)

    def due_for_cancel_check(self, now: float, every_s: float) -> list[tuple[str, Inflight]]:
        with self._lock:
            due = [(rid, s) for rid, s in self._states.items() if s.next_cancel_check <= now]
            for _, state in due:
                state.next_cancel_check = now + every_s
        return due

    def take_all(self) -> list[Inflight]:
        with self._lock:
            left = list(self._states.values())
            self._states.clear()
        return left

    def deliver(self, rid: str, delta: Delta) -> None:
        """One merged delta of a completion (the sender thread). A cancelled or failed
        completion ends the whole request with one error response."""
        failed = delta.finish_reason in _ENDS_REQUEST
        with self._lock:
            state = self._states.get(rid)
            if state is not None and (delta.request_done or failed):
                del self._states[rid]
        if state is None:
            return
        if not state.stream and not failed:
            state.deltas.setdefault(delta.sequence_index, []).append(delta)
            if not delta.finished:
                return
            delta = Delta.merge(state.deltas.pop(delta.sequence_index))
            if state.echo:
                delta.text = state.echo + delta.text
        try:
            response = self.responses.for_delta(delta, state.outputs, self.shutting_down,
                                                state.returns)
            state.send(response, delta.request_done or failed, self._final_flag)
        except Exception as e:  # noqa: BLE001 - a vanished client must not stop the sender
            self._warn(f"hsserve: send failed for {rid}: {e}")
            if not delta.request_done:
                self._abort(rid)
                self.forget(rid)

    def send_error(self, state: Inflight, message: str, code=None) -> None:
        try:
            state.send(self.responses.error(message, code), True, self._final_flag)
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self._warn(f"hsserve: could not send an error response: {e}")
