"""Other backends' request shapes (vllm_backend, TensorRT-LLM) parse into the same request as ours.

Issue 25: other backends' request shapes parse into the same request as ours: vllm_backend's
string numbers, exclude_input_in_output and return_* flags, TensorRT-LLM's input names."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hsserve.request import RequestError
from hsserve.triton.tensors import parse_request


def strings(*values: str) -> np.ndarray:
    return np.array([v.encode() for v in values], dtype=np.object_)


def parse(tensors: dict, parameters=None, exclude_default: bool = True):
    base = {"text_input": strings("Hello there")}
    return parse_request("r", {**base, **tensors}, parameters, 16, exclude_default)


def test_vllm_backend_sample_client_request():
    """samples/client.py of vllm_backend: numbers as strings in sampling_parameters."""
    js = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    p = parse({"sampling_parameters": strings(json.dumps(js)),
               "exclude_input_in_output": np.array([False]), "stream": np.array([False])})
    sp = p.request.sampling
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (pytest.approx(0.1), 0.95, 100)
    assert p.echo, "exclude_input_in_output false, not streamed: the prompt is echoed"


def test_vllm_logprobs_count_as_a_string():
    p = parse({"sampling_parameters": strings(json.dumps({"logprobs": "2"}))})
    assert p.request.sampling.logprobs == 2
    p = parse({"return_logprobs": np.array([True])})
    assert p.request.sampling.logprobs == 0, "the flag alone: the sampled tokens' own"
    assert parse({}).request.sampling.logprobs is None


def test_genai_perf_vllm_request():
    js = {"max_tokens": "256", "min_tokens": "256"}
    p = parse({"sampling_parameters": strings(json.dumps(js)),
               "exclude_input_in_output": np.array([True]), "stream": np.array([True])})
    assert (p.request.sampling.max_tokens, p.request.sampling.min_tokens) == (256, 256)
    assert not p.echo and p.stream


@pytest.mark.parametrize("value", ["lots", "2.5", "", "1e3x"])
def test_a_string_that_is_not_a_number_is_refused_naming_the_field(value):
    with pytest.raises(RequestError) as e:
        parse({"sampling_parameters": strings(json.dumps({"max_tokens": value}))})
    assert e.value.input_name == "sampling_parameters.max_tokens"


def test_string_booleans_and_request_parameters():
    p = parse({}, parameters=json.dumps({"ignore_eos": "true", "max_tokens": "7", "seed": "3"}))
    sp = p.request.sampling
    assert (sp.ignore_eos, sp.max_tokens, sp.seed) == (True, 7, 3)
    assert parse({}, {"ignore_eos": "False"}).request.sampling.ignore_eos is False
    with pytest.raises(RequestError, match="ignore_eos"):
        parse({}, {"ignore_eos": "yes please"})


@pytest.mark.parametrize("given,stream,default,echo", [
    (None, False, True, False),  # ours: the completion only
    (None, False, False, True),  # the server's default set to vllm_backend's
    (False, False, True, True), (True, False, False, False),
    (False, True, True, False), (None, True, False, False),  # streamed deltas never echo
])
def test_exclude_input_in_output(given, stream, default, echo):
    tensors = {"stream": np.array([stream])}
    if given is not None:
        tensors["exclude_input_in_output"] = np.array([given])
    assert parse(tensors, exclude_default=default).echo is echo


def test_return_flags():
    p = parse({"return_finish_reason": np.array([True]), "return_num_output_tokens": np.array([True]),
               "return_num_input_tokens": np.array([False])})
    assert p.returns == {"finish_reason", "num_output_tokens"}
    assert parse({}).returns == frozenset()


def test_tensorrt_llm_inputs_map_to_ours():
    p = parse({"max_tokens": np.array([32], np.int32), "min_length": np.array([4], np.int32),
               "stop_words": strings("\n\n", "END"), "random_seed": np.array([9], np.uint64),
               "end_id": np.array([2], np.int32), "pad_id": np.array([0], np.int32),
               "bad_words": strings(""), "beam_width": np.array([1], np.int32),
               "stop_token_ids": np.array([5], np.int32)})
    sp = p.request.sampling
    assert (sp.max_tokens, sp.min_tokens, sp.seed) == (32, 4, 9)
    assert sp.stop == ("\n\n", "END") and sp.stop_token_ids == (5, 2)


@pytest.mark.parametrize("name,value,word", [
    ("bad_words", strings("darn"), "not supported"),
    ("beam_width", np.array([4], np.int32), "beam search"),
    ("end_id", np.array([-1], np.int32), "end_id"),
])
def test_tensorrt_llm_inputs_we_cannot_honour_are_refused(name, value, word):
    with pytest.raises(RequestError, match=word) as e:
        parse({name: value})
    assert e.value.input_name == name


def test_min_tokens_above_max_tokens_is_refused():
    sp = parse({"min_tokens": np.array([9], np.int32), "max_tokens": np.array([4], np.int32)})
    with pytest.raises(RequestError, match="min_tokens"):
        sp.request.sampling.validate(4096, 1)


def test_stream_interval_from_sampling_parameters_or_request_parameters():
    assert parse({}).stream_interval is None, "the server's default"
    assert parse({"sampling_parameters": strings('{"stream_interval": "8"}')}).stream_interval == 8
    assert parse({}, {"stream_interval": 3}).stream_interval == 3
    for bad in ('{"stream_interval": 0}', '{"stream_interval": 1.5}'):
        with pytest.raises(RequestError, match="stream_interval"):
            parse({"sampling_parameters": strings(bad)})
