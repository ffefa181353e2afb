"""The adapter's ResponseSender: what it merges into one response; it never holds a final back.

The Triton adapter's ResponseSender without Triton: what it merges into one response, and what
it never holds back."""

from __future__ import annotations

import time

from hsserve.request import Delta, FinishReason
from hsserve.triton.sender import ResponseSender


class Sender:
    """A ResponseSender over a recording deliver, `inflight` streams in flight."""

    def __init__(self, rate: int, inflight: int, interval: int = 1):
        self.sent: list[tuple[float, str, Delta]] = []
        self.model = ResponseSender(rate, lambda: inflight, self._record, lambda _rid: interval)
        self.model.start()

    def _record(self, rid: str, d: Delta) -> None:
        self.sent.append((time.monotonic(), rid, d))

    def put(self, d: Delta) -> None:
        self.model.put(d)

    def stop(self) -> None:
        self.model.stop(timeout=5)
        assert not self.model._thread.is_alive()


def token(rid: str, t: int, final: bool = False) -> Delta:
    return Delta(rid, [t], str(t), finish_reason=FinishReason.LENGTH if final else None,
                 request_done=final)


def test_a_lone_stream_gets_every_token_at_once():
    s = Sender(rate=4000, inflight=1)  # NOTE: a gap of 0.25 ms
    for t in range(5):
        s.put(token("a", t))
        time.sleep(0.005)
    s.put(token("a", 5, final=True))
    s.stop()
    assert [d.token_ids for _, _, d in s.sent] == [[0], [1], [2], [3], [4], [5]]


def test_many_streams_get_several_tokens_per_response():
    s = Sender(rate=1000, inflight=100)  # NOTE: 100 streams / 1000 per s: 0.1 s between responses
    start = time.monotonic()
    for t in range(20):
        s.put(token("a", t))
        time.sleep(0.01)
    elapsed = time.monotonic() - start
    s.put(token("a", 20, final=True))
    s.stop()
    got = [d.token_ids for _, _, d in s.sent]
    assert got[0] == [0], "the first response is never held"
    assert [t for ids in got for t in ids] == list(range(21)), "nothing lost, order kept"
    # NOTE: the first, one per 0.1 s while tokens came (~0.2 s unless the machine is slow), the final
    assert len(got) <= 3 + int(elapsed / 0.1), (got, elapsed)
    times = [t - start for t, _, _ in s.sent]
    assert all(b - a >= 0.09 for a, b in zip(times[:-2], times[1:-1])), times


def test_finals_and_stop_are_never_held():
    s = Sender(rate=10, inflight=100)  # NOTE: 10 s between responses
    s.put(token("a", 0))
    s.put(token("b", 0))
    time.sleep(0.05)
    s.put(token("a", 1))
    s.put(token("a", 2, final=True))  # NOTE: due now, with the held token before it
    s.put(token("b", 1))  # NOTE: held ...
    want = [("a", [0]), ("b", [0]), ("a", [1, 2])]
    deadline = time.monotonic() + 5
    while len(s.sent) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert [(rid, d.token_ids) for _, rid, d in s.sent] == want
    t0 = time.monotonic()
    s.stop()  # NOTE: ... until the sender stops
    assert time.monotonic() - t0 < 1
    assert [(rid, d.token_ids) for _, rid, d in s.sent][-1] == ("b", [1])


def test_a_request_ends_after_all_its_completions():
    """n = 2: the response that ends the request goes after the other completion's final, even
    when both arrive in one round (the adapter forgets a request once it has ended)."""
    s = Sender(rate=10, inflight=100)
    record = s.model.deliver

    def slow_first_rounds(rid, d):  # NOTE: keeps the sender busy while the rest is queued
        record(rid, d)
        if len(s.sent) <= 2:
            time.sleep(0.1)

    s.model.deliver = slow_first_rounds
    for i in (1, 0):
        s.put(Delta("r", [0], "", sequence_index=i))
    time.sleep(0.02)
    for d in [Delta("r", [1], "", sequence_index=1),
              Delta("r", [1], "", sequence_index=0),
              Delta("r", [2], "", finish_reason=FinishReason.LENGTH, sequence_index=0),
              Delta("r", [2], "", finish_reason=FinishReason.LENGTH, sequence_index=1,
                    request_done=True)]:
        s.put(d)
    time.sleep(0.4)
    s.stop()
    sent = [(d.sequence_index, d.token_ids, d.request_done) for _, _, d in s.sent]
    assert sent == [(1, [0], False), (0, [0], False), (0, [1, 2], False), (1, [1, 2], True)]


def test_a_final_does_not_wait_behind_responses_held_for_the_budget():
    """At many streams the budget keeps the sender busy; a final (it frees the client for its next
    request) goes before the responses that are merely due, not after a whole round of them."""
    s = Sender(rate=1000, inflight=40)  # NOTE: 40 ms between a stream's responses
    record = s.model.deliver

    def slow(rid, d):  # NOTE: a send() of 3 ms
        time.sleep(0.003)
        record(rid, d)

    s.model.deliver = slow
    for i in range(40):
        s.put(token(f"r{i}", 0))  # NOTE: 40 firsts: one round of ~120 ms
    time.sleep(0.02)
    s.put(token("r39", 1, final=True))
    for i in range(39):
        s.put(token(f"r{i}", 1))  # NOTE: due by the time the round of firsts ends
    deadline = time.monotonic() + 5
    while len(s.sent) < 41 and time.monotonic() < deadline:
        time.sleep(0.005)
    s.stop()
    assert [rid for _, rid, _ in s.sent[:40]] == [f"r{i}" for i in range(40)]
    _, rid, d = s.sent[40]
    assert (rid, d.token_ids, d.request_done) == ("r39", [1], True), s.sent[40]
    assert sorted(rid for _, rid, _ in s.sent[41:]) == sorted(f"r{i}" for i in range(39))


def test_stream_interval_sends_the_first_at_once_then_n_tokens_a_response():
    s = Sender(rate=0, inflight=1, interval=4)
    for t in range(10):
        s.put(token("a", t))
        time.sleep(0.003)
    s.put(token("a", 10, final=True))
    s.stop()
    assert [d.token_ids for _, _, d in s.sent] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert s.sent[-1][2].request_done


def test_stream_interval_caps_what_the_budget_merges():
    s = Sender(rate=10, inflight=10, interval=3)  # NOTE: a second between responses
    s.put(token("a", 0))
    time.sleep(0.05)
    for t in range(1, 12):
        s.put(token("a", t))
    s.put(token("a", 12, final=True))
    s.stop()
    got = [d.token_ids for _, _, d in s.sent]
    assert got[0] == [0]
    assert [t for ids in got for t in ids] == list(range(13)), "nothing lost, order kept"
    assert all(len(ids) <= 3 for ids in got), got
