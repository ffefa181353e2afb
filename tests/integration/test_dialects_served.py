"""The real tritonserver serves vllm_backend's and TensorRT-LLM's request shapes (Issue 25).

Issue 25 through the real tritonserver: vllm_backend's request shapes (string numbers,
exclude_input_in_output true / false / absent, stream true / false, settings as request
parameters, the return_* outputs), TensorRT-LLM's names, and hidden_layers without MODE."""

from __future__ import annotations

import json

from triton_helpers import stream_once, unary_grpc

PROMPT = "The capital of France is"


def vllm(js: dict, **fields) -> dict:
    return {"text_input": PROMPT, "sampling_parameters": json.dumps(js), **fields}


def test_vllm_backend_sample_request_echoes_the_prompt_when_not_streamed(triton_server):
    url, js = triton_server.grpc_url, {"temperature": "0", "max_tokens": "8", "ignore_eos": "true"}
    plain = stream_once(url, vllm(js, stream=False, exclude_input_in_output=True))
    echoed = stream_once(url, vllm(js, stream=False, exclude_input_in_output=False))
    absent = stream_once(url, vllm(js, stream=False))
    streamed = stream_once(url, vllm(js, stream=True, exclude_input_in_output=False))
    for r in (plain, echoed, absent, streamed):
        assert r.error is None, r.error
    completion = plain.cat("text_output")
    assert len(plain.cat("output_ids")) == 8 and completion
    assert echoed.cat("text_output") == PROMPT + completion, "false: the prompt, then the text"
    assert absent.cat("text_output") == completion, "absent: this server's default (no echo)"
    assert streamed.cat("text_output") == completion, "streamed deltas never echo"
    assert list(echoed.cat("output_ids")) == list(plain.cat("output_ids"))


def test_settings_as_request_parameters_with_string_numbers(triton_server):
    r = stream_once(triton_server.grpc_url, {"text_input": PROMPT, "stream": True},
                    parameters={"max_tokens": "5", "temperature": "0", "ignore_eos": "true"})
    assert r.error is None, r.error
    assert len(r.cat("output_ids")) == 5


def test_a_string_that_is_no_number_is_refused_naming_the_field(triton_server):
    r = stream_once(triton_server.grpc_url, vllm({"max_tokens": "many"}, stream=True))
    assert r.error is not None and "sampling_parameters.max_tokens" in r.error.message()


def test_return_outputs_on_every_response(triton_server):
    js = {"temperature": "0", "max_tokens": "6", "ignore_eos": "true"}
    r = stream_once(triton_server.grpc_url, vllm(
        js, stream=True, exclude_input_in_output=True, return_finish_reason=True,
        return_num_input_tokens=True, return_num_output_tokens=True))
    assert r.error is None, r.error
    reasons = [x["finish_reason"].reshape(-1)[0].decode() for x in r.responses]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {"None"}
    counts = [int(x["num_output_tokens"].reshape(-1)[0]) for x in r.responses]
    ids = [len(x["output_ids"]) for x in r.responses]
    assert counts == ids and sum(counts) == 6, "each response counts its own tokens"
    assert len({int(x["num_input_tokens"].reshape(-1)[0]) for x in r.responses}) == 1
    plain = stream_once(triton_server.grpc_url, vllm(js, stream=True))
    assert all(x["finish_reason"] is None for x in plain.responses[:-1]), "ours: final only"
    assert int(plain.final("num_output_tokens")[0]) == 6


def test_tensorrt_llm_request(triton_server):
    """genai-perf --backend tensorrtllm: text_input, max_tokens, min_length, stream."""
    fields = {"text_input": PROMPT, "max_tokens": 7, "min_length": 7, "stream": True,
              "exclude_input_in_output": True, "temperature": 0.0, "end_id": 2, "pad_id": 2,
              "bad_words": [""], "stop_words": ["NOT IN THE TEXT"], "beam_width": 1}
    r = stream_once(triton_server.grpc_url, fields)
    assert r.error is None, r.error
    assert len(r.cat("output_ids")) == 7 and r.cat("text_output")
    bad = stream_once(triton_server.grpc_url, {**fields, "bad_words": ["Paris"]})
    assert bad.error is not None and "bad_words" in bad.error.message()


def test_hidden_layers_without_mode_is_an_error_naming_mode(triton_server):
    url = triton_server.grpc_url
    r = stream_once(url, {"text_input": PROMPT, "hidden_layers": [-1]})
    assert r.error is not None and "hidden_layers" in r.error.message()
    assert "MODE is none" in r.error.message()
    r = stream_once(url, {"text_input": PROMPT, "hidden_layers": [999]})
    assert r.error is not None and "hidden_layers" in r.error.message() and "outside" in r.error.message()


def test_llm_sync_echoes_as_llm_does(triton_server):
    js = {"temperature": "0", "max_tokens": "4", "ignore_eos": "true"}
    out = unary_grpc(triton_server.grpc_url, vllm(js, exclude_input_in_output=False))
    assert out["text_output"].reshape(-1)[0].decode().startswith(PROMPT)


def test_logprobs_served(triton_server, smollm_engine):
    """Typed outputs (num_logprobs) equal the engine's; vllm_backend's JSON and cumulative_logprob
    under return_logprobs / return_cumulative_logprob, on every response."""
    from hsserve import GenerationRequest, SamplingParams

    url = triton_server.grpc_url
    r = stream_once(url, {"text_input": PROMPT, "max_tokens": 5, "temperature": 0.0,
                          "ignore_eos": True, "num_logprobs": 3, "stream": True})
    assert r.error is None, r.error
    want = smollm_engine.generate(GenerationRequest("lp", prompt=PROMPT, sampling=SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)), timeout=120)
    got = r.cat("output_logprobs")
    assert len(got) == 5 and max(abs(a - e.logprob) for a, e in zip(got, want.logprobs)) < 1e-4
    ids = r.cat("top_logprob_ids")
    assert ids.shape == (5, 3) and ids.tolist() == [e.top_ids for e in want.logprobs]
    js = {"temperature": "0", "max_tokens": "4", "ignore_eos": "true", "logprobs": "2"}
    v = stream_once(url, vllm(js, stream=True, return_logprobs=True,
                              return_cumulative_logprob=True))
    assert v.error is None, v.error
    per_token = [e for x in v.responses for e in json.loads(x["logprobs"].reshape(-1)[0])]
    tokens = [int(t) for t in v.cat("output_ids")]
    assert len(per_token) == 4 and all(str(t) in e for t, e in zip(tokens, per_token))
    assert all(1 <= len(e) <= 3 for e in per_token)
    total = sum(e[str(t)]["logprob"] for t, e in zip(tokens, per_token))
    assert abs(float(v.responses[-1]["cumulative_logprob"][0]) - total) < 1e-3
    assert all(x["cumulative_logprob"] is not None for x in v.responses)


def test_prompt_logprobs_served(triton_server, smollm_dir, hf_model):
    """prompt_logprobs (an input, or sampling_parameters, string numbers too) answered once:
    prompt_token_logprobs NaN first, then transformers' log_softmax within 1e-4; k alternatives;
    llm_sync gives the same; a bad value is refused naming the input."""
    import numpy as np
    import torch

    hf = hf_model(smollm_dir)
    url = triton_server.grpc_url
    r = stream_once(url, {"text_input": PROMPT, "max_tokens": 3, "temperature": 0.0,
                          "prompt_logprobs": 2, "stream": True})
    assert r.error is None, r.error
    assert sum(x.get("prompt_token_logprobs") is not None for x in r.responses) == 1
    got, ids = r.cat("prompt_token_logprobs"), r.cat("prompt_top_logprob_ids")
    prompt = hf_prompt_ids(smollm_dir)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), -1)
    want = ref[torch.arange(len(prompt) - 1), prompt[1:]].numpy()
    assert len(got) == len(prompt) and np.isnan(got[0])
    assert np.abs(got[1:] - want).max() <= 1e-4
    assert ids.shape == (len(prompt), 2) and ids[0].tolist() == [-1, -1]
    assert np.abs(r.cat("prompt_top_logprobs")[1:] - ref.topk(2).values.numpy()).max() <= 1e-4
    js = {"temperature": "0", "max_tokens": "2", "prompt_logprobs": "0"}
    out = unary_grpc(url, vllm(js))
    assert np.allclose(out["prompt_token_logprobs"], got, equal_nan=True, atol=1e-5)
    bad = stream_once(url, {"text_input": PROMPT, "max_tokens": 2, "prompt_logprobs": 99})
    assert bad.error is not None and "prompt_logprobs" in str(bad.error)


def hf_prompt_ids(folder: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
