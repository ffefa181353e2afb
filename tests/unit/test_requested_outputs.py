"""The Triton adapter builds only the outputs a request asked for (all when it named none), with
a stand-in for pb_utils that records each response's tensors."""

from __future__ import annotations

import numpy as np
import torch

from hsserve.request import Delta, FinishReason
from hsserve.triton.inflight import Inflight, InflightRequests
from hsserve.triton.responses import Responses, requested_outputs
from hsserve.triton.tensors import OUTPUTS


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, value):
            self.name, self.value = name, value

        @staticmethod
        def from_dlpack(name, capsule):
            return FakePb.Tensor(name, torch.utils.dlpack.from_dlpack(capsule))

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.outputs = output_tensors


class Request:
    def __init__(self, names):
        self.names = names

    def requested_output_names(self):
        return self.names


class Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags=0):
        self.sent.append(({t.name: t.value for t in response.outputs}, flags))


def responses(want, deltas):
    requests = InflightRequests(Responses(FakePb), abort=print, warn=print)
    state = Inflight(Sender(), stream=True, outputs=requested_outputs(Request(want)))
    requests.add("a", state)
    for d in deltas:
        requests.deliver("a", d)
    return state.sender.sent


def deltas():
    rows = torch.ones(1, 4)
    return [Delta("a", [5, 6], "hi", hidden=rows),
            Delta("a", [7], "!", hidden=rows, finish_reason=FinishReason.LENGTH,
                  num_input_tokens=3, num_output_tokens=3, request_done=True)]


def test_a_request_naming_no_outputs_gets_them_all():
    assert requested_outputs(Request([])) == frozenset(OUTPUTS)
    first, last = responses([], deltas())
    assert set(first[0]) == {"text_output", "output_ids", "sequence_index", "HIDDEN_STATES"}
    assert set(last[0]) == set(OUTPUTS) and last[1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert last[0]["text_output"].tolist() == [b"!"] and last[0]["num_output_tokens"] == [3]
    np.testing.assert_array_equal(first[0]["output_ids"], np.array([5, 6], np.int32))


def test_only_the_outputs_asked_for_are_built():
    asked = ["output_ids", "num_output_tokens", "not_an_output"]
    assert requested_outputs(Request(asked)) == {"output_ids", "num_output_tokens"}
    first, last = responses(asked, deltas())
    assert list(first[0]) == ["output_ids"], "no text, sequence index or rows built"
    assert list(last[0]) == ["output_ids", "num_output_tokens"]
    assert last[1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, "the final flag all the same"
    first, last = responses(["HIDDEN_STATES"], deltas())
    assert list(first[0]) == ["HIDDEN_STATES"] and list(last[0]) == ["HIDDEN_STATES"]
    assert torch.equal(first[0]["HIDDEN_STATES"], torch.ones(1, 4))
