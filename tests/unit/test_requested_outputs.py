"""The Triton adapter builds only the outputs a request asked for (all when it named none).

With a stand-in for pb_utils that records each response's tensors; the logprob outputs and
vllm_backend's JSON included."""

from __future__ import annotations

import json

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
    logprob_outputs = {"output_logprobs", "top_logprob_ids", "top_logprobs", "cumulative_logprob",
                       "logprobs", "prompt_token_logprobs", "prompt_top_logprob_ids",
                       "prompt_top_logprobs"}  # NOTE: only for requests that ask for logprobs
    assert set(last[0]) == set(OUTPUTS) - logprob_outputs
    assert last[1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
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


def test_logprob_outputs_and_vllm_backend_json():
    from hsserve.request import TokenLogprob

    entries = [TokenLogprob(-0.5, 1, [5, 9], [-0.5, -1.5]), TokenLogprob(-2.0, 3, [8, 4], [-0.2, -0.9])]
    d = Delta("a", [5, 6], "hi", logprobs=entries, cumulative_logprob=-2.5,
              finish_reason=FinishReason.LENGTH, request_done=True)
    r = Responses(FakePb, decode=lambda t: f"<{t}>")
    out = {t.name: t.value for t in r.for_delta(d, frozenset(OUTPUTS),
                                                 returns=frozenset({"logprobs", "cumulative_logprob"})).outputs}
    np.testing.assert_array_equal(out["output_logprobs"], np.float32([-0.5, -2.0]))
    assert out["top_logprob_ids"].tolist() == [[5, 9], [8, 4]]
    assert out["cumulative_logprob"].tolist() == [-2.5]
    js = json.loads(out["logprobs"][0])
    assert js[0] == {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "<5>"},
                     "9": {"logprob": -1.5, "rank": 2, "decoded_token": "<9>"}}
    assert set(js[1]) == {"6", "8", "4"} and js[1]["6"]["rank"] == 3
    plain = {t.name for t in r.for_delta(d, frozenset(OUTPUTS)).outputs}
    assert "logprobs" not in plain and "cumulative_logprob" not in plain, "vllm's only on its flags"


def test_prompt_logprob_outputs_once_with_nan_first():
    from hsserve.request import TokenLogprob

    entries = [None, TokenLogprob(-1.0, 2, [3, 4], [-0.5, -1.0]),
               TokenLogprob(-0.1, 1, [7, 2], [-0.1, -3.0])]
    d = Delta("a", [5], "x", prompt_logprobs=entries)
    out = {t.name: t.value for t in Responses(FakePb).for_delta(d, frozenset(OUTPUTS)).outputs}
    lp = out["prompt_token_logprobs"]
    assert lp.dtype == np.float32 and np.isnan(lp[0]) and lp[1:].tolist() == [-1.0, np.float32(-0.1)]
    assert out["prompt_top_logprob_ids"].tolist() == [[-1, -1], [3, 4], [7, 2]]
    assert np.isnan(out["prompt_top_logprobs"][0]).all()
    k0 = Delta("a", [5], "x", prompt_logprobs=[None, TokenLogprob(-1.0, 2, [], [])])
    names = {t.name for t in Responses(FakePb).for_delta(k0, frozenset(OUTPUTS)).outputs}
    assert "prompt_token_logprobs" in names and "prompt_top_logprob_ids" not in names
    later = {t.name for t in Responses(FakePb).for_delta(Delta("a", [6], "y"),
                                                         frozenset(OUTPUTS)).outputs}
    assert "prompt_token_logprobs" not in later
