"""RequestStream: the client side of one request."""

from __future__ import annotations

from hsserve.request import Delta, FinishReason
from hsserve.request_stream import RequestStream


def test_result_asked_twice_returns_the_same():
    """A second result() must not wait for deltas that the first one consumed."""
    s = RequestStream("r")
    s(Delta("r", [5], "a"))
    s(Delta("r", [6], "b", finish_reason=FinishReason.LENGTH, request_done=True))
    first = s.result(timeout=1)
    assert first.token_ids == [5, 6] and first.text == "ab" and first.num_deltas == 2
    assert s.result(timeout=1) is first
    assert s.results(timeout=1) == [first]
