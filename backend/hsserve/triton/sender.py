"""ResponseSender: the thread that turns the engine's deltas into sends, paced and ordered.

Per completion, what piled up is merged into one response. With a rate budget, a completion's
next response waits until (streams in flight / budget) seconds after its last one, so at 64
streams each response carries several tokens while a lone stream gets every token at once.
Firsts and finals never wait for the budget and go first in a round (a first is its client's
TTFT, a final frees its client for the next request); then at most ROUND_DUE of the responses
merely due, longest due first (bench/README.md#response-sender).

A completion's stream_interval N > 1: its first response goes at once, then one each N tokens
(the final: what is left), never more than N a response, whatever the budget would merge.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from hsserve.request import Delta

ROUND_DUE = 8  # responses held for the budget sent per round, at most
_STOP = None


class ResponseSender:
    def __init__(self, rate: int, streams: Callable[[], int],
                 deliver: Callable[[str, Delta], None],
                 interval: Callable[[str], int] = lambda _rid: 1):
        """rate: responses a second over all streams (0: no budget); streams(): how many are in
        flight; deliver(request_id, merged delta): sends it (on this thread); interval(request_id):
        its stream_interval."""
        self.rate, self._streams, self.deliver = rate, streams, deliver
        self._interval = interval
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._held: dict[tuple[str, int], list[Delta]] = {}
        self._next_at: dict[tuple[str, int], float] = {}
        self._thread = threading.Thread(target=self._run, name="hsserve-sender", daemon=True)

    def start(self) -> ResponseSender:
        self._thread.start()
        return self

    def put(self, delta: Delta) -> None:
        """The engine's sink for every request (any thread; never blocks)."""
        self._outbox.put(delta)

    def stop(self, timeout: float = 30.0) -> None:
        """Send what is held, then end the thread."""
        self._outbox.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        stop = False
        while not stop or self._held:
            stop = self._gather(stop) or stop
            now = time.monotonic()
            gap = self._streams() / self.rate if self.rate else 0.0
            for key in self._round(now, stop):
                groups, rest = self._responses(key, self._held.pop(key), stop)
                if rest:
                    self._held[key] = rest
                if groups[-1][-1].finished:
                    self._next_at.pop(key, None)
                else:
                    self._next_at[key] = now + gap
                for deltas in groups:
                    self.deliver(key[0], Delta.merge(deltas))

    def _responses(self, key: tuple[str, int], deltas: list[Delta], stop: bool
                   ) -> tuple[list[list[Delta]], list[Delta]]:
        """A completion's held deltas -> (its responses' deltas, those held back): all in one
        under stream_interval 1, else groups of N tokens, the rest held unless final or first."""
        n = self._interval(key[0])
        if n <= 1:
            return [deltas], []
        groups, cur, count = [], [], 0
        for d in deltas:
            cur.append(d)
            count += len(d.token_ids)
            if count >= n:
                groups.append(cur)
                cur, count = [], 0
        if cur and (stop or cur[-1].finished or not groups and key not in self._next_at):
            groups.append(cur)
            cur = []
        return groups, cur

    def _ready(self, key: tuple[str, int], deltas: list[Delta]) -> bool:
        """Whether a completion already answered once holds a response's worth (N tokens)."""
        n = self._interval(key[0])
        return n <= 1 or sum(len(d.token_ids) for d in deltas) >= n

    def _gather(self, stop: bool) -> bool:
        """Wait for deltas (until the soonest held one is due) and hold them; True at the stop."""
        timeout = None
        waiting = [k for k, ds in self._held.items()
                   if k not in self._next_at or ds[-1].finished or self._ready(k, ds)]
        if waiting:
            soonest = min(self._next_at.get(k, 0.0) for k in waiting)
            timeout = max(0.0, soonest - time.monotonic())
        batch: list = []
        try:
            if not stop:
                batch.append(self._outbox.get(timeout=timeout))
            while True:
                batch.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        for d in batch:
            if d is _STOP:
                stop = True
            else:
                self._held.setdefault((d.request_id, d.sequence_index), []).append(d)
        return stop

    def _round(self, now: float, stop: bool) -> list[tuple[str, int]]:
        """This round's completions, in the order they are sent."""
        urgent, due = [], []
        for key, deltas in self._held.items():
            if stop or deltas[-1].finished or key not in self._next_at:
                urgent.append(key)
            elif now >= self._next_at[key] and self._ready(key, deltas):
                due.append(key)
        # NOTE: a request's last response goes after its other completions' finals of this round:
        # once it is sent, the request is forgotten
        urgent.sort(key=lambda k: self._held[k][-1].request_done)
        due.sort(key=self._next_at.__getitem__)
        return urgent + due[:ROUND_DUE]
