"""RequestStream: a result asked twice is the same; one after a timeout keeps what was taken.

RequestStream: the client side of one request."""

from __future__ import annotations

import queue

import pytest

from hsserve.request import Delta, FinishReason
from hsserve.engine.request_stream import RequestStream


def test_result_asked_twice_returns_the_same():
    """A second result() must not wait for deltas that the first one consumed."""
    s = RequestStream("r")
    s(Delta("r", [5], "a"))
    s(Delta("r", [6], "b", finish_reason=FinishReason.LENGTH, request_done=True))
    first = s.result(timeout=1)
    assert first.token_ids == [5, 6] and first.text == "ab" and first.num_deltas == 2
    assert s.result(timeout=1) is first
    assert s.results(timeout=1) == [first]


def test_result_after_a_timeout_keeps_what_was_taken():
    s = RequestStream("r")
    s(Delta("r", [5], "a"))
    with pytest.raises(queue.Empty):
        s.result(timeout=0.01)  # NOTE: takes the first delta, then times out
    s(Delta("r", [6], "b", finish_reason=FinishReason.LENGTH, request_done=True))
    assert s.result(timeout=1).token_ids == [5, 6]
