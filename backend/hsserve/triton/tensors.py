"""Triton tensors -> the engine's request, with no Triton import: inputs arrive as a dict of numpy
arrays (and the request's parameters JSON), so parsing is testable and fuzzable on its own.

Precedence for each setting: typed input tensor > `sampling_parameters` JSON > request
parameters (e.g. extra fields of an HTTP generate body) > server default. Other backends'
dialects (dialects.py) are translated here, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from hsserve.request import (GenerationRequest, GuidedDecoding, HiddenStatesMode, RequestError,
                             SamplingParams)
from hsserve.triton import dialects
from hsserve.triton.values import (as_bool, as_float, as_int, as_int_list, as_str, as_str_list)

INPUTS = (
    "text_input", "input_ids", "stream", "max_tokens", "min_tokens", "temperature", "top_p",
    "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "n", "sampling_parameters", "MODE",
    "hidden_layers", "exclude_input_in_output", "num_logprobs", "prompt_logprobs",
    *dialects.RETURNS, *dialects.TRTLLM_INPUTS,
)
OUTPUTS = (
    "text_output", "output_ids", "HIDDEN_STATES", "finish_reason", "num_input_tokens",
    "num_output_tokens", "sequence_index", "output_logprobs", "top_logprob_ids", "top_logprobs",
    "cumulative_logprob", "logprobs", "prompt_token_logprobs", "prompt_top_logprob_ids",
    "prompt_top_logprobs",
)

_INT32 = 2**31 - 1
# Settings that may also come through the JSON / request parameters, with their parsers.
_SETTINGS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": lambda n, v: as_int(n, v, 0, _INT32),
    "min_tokens": lambda n, v: as_int(n, v, 0, _INT32),
    "temperature": as_float,
    "top_p": as_float,
    "top_k": lambda n, v: as_int(n, v, -1, _INT32),
    "seed": lambda n, v: as_int(n, v, 0, 2**64 - 1),
    "stop": as_str_list,
    "stop_token_ids": lambda n, v: as_int_list(n, v, 0, _INT32),
    "ignore_eos": as_bool,
    "n": lambda n, v: as_int(n, v, 1, _INT32),
    "MODE": as_str,
    "hidden_layers": lambda n, v: as_int_list(n, v, -(2**31), _INT32),
    "stream": as_bool,
    "exclude_input_in_output": as_bool,
    "num_logprobs": lambda n, v: as_int(n, v, 0, _INT32),
    "prompt_logprobs": lambda n, v: as_int(n, v, 0, _INT32),
    "stream_interval": lambda n, v: as_int(n, v, 1, _INT32),
    "guided_decoding": GuidedDecoding.parse,
    **dict.fromkeys(dialects.RETURNS, as_bool),
}
# NOTE: vllm_backend's JSON names for the same settings (newer vLLM: structured_outputs)
_ALIASES = {"logprobs": "num_logprobs", "structured_outputs": "guided_decoding"}
_SCALAR_INPUTS = {
    "stream", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
    "n", "MODE", "text_input", "sampling_parameters", "exclude_input_in_output", "min_length",
    "random_seed", "num_logprobs", "prompt_logprobs", *dialects.RETURNS,
}


@dataclass
class ParsedRequest:
    request: GenerationRequest
    stream: bool
    echo: bool = False  # a non-streamed text_output starts with the prompt (vllm_backend's)
    returns: frozenset = frozenset()  # vllm_backend's return_* outputs, on every response
    stream_interval: int | None = None  # tokens a streamed response; None: the server's


def _json_settings(source: str, raw: Any) -> dict[str, Any]:
    if isinstance(raw, (bytes, str)):
        text = as_str(source, raw)
        if not text.strip():
            return {}
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise RequestError(source, f"is not valid JSON: {e.msg} at position {e.pos}") from None
    if not isinstance(raw, dict):
        raise RequestError(source, "must be a JSON object")
    return raw


def _tensor_value(name: str, arr: np.ndarray) -> Any:
    if name in _SCALAR_INPUTS:
        if arr.size != 1:
            raise RequestError(name, f"expected exactly one element, got shape {list(arr.shape)}")
        return arr.reshape(-1)[0]
    return arr.reshape(-1)


def _settings(tensors: Mapping[str, np.ndarray], parameters) -> dict[str, Any]:
    """Every setting given, by precedence (later sources overwrite earlier ones)."""
    values: dict[str, Any] = {}
    # request parameters: unknown keys are ignored (Triton and clients add their own)
    params = _json_settings("parameters", parameters) if parameters else {}
    for name, v in params.items():
        key = _ALIASES.get(name, name)
        if key in _SETTINGS:
            values[key] = _SETTINGS[key](name, dialects.unstring(name, key, v))
    if "sampling_parameters" in tensors:
        js = _json_settings("sampling_parameters", _tensor_value("sampling_parameters",
                                                                  tensors["sampling_parameters"]))
        unknown = sorted(set(js) - set(_SETTINGS) - set(_ALIASES))
        if unknown:
            allowed = sorted(set(_SETTINGS) | set(_ALIASES))
            raise RequestError("sampling_parameters", f"unknown field(s) {unknown}; allowed: {allowed}")
        for field, v in js.items():
            key, name = _ALIASES.get(field, field), f"sampling_parameters.{field}"
            values[key] = _SETTINGS[key](name, dialects.unstring(name, key, v))
    for name, arr in tensors.items():
        if name in ("text_input", "input_ids", "sampling_parameters"):
            continue
        key = dialects.TRTLLM_RENAMES.get(name, name)
        if key in _SETTINGS:
            values[key] = _SETTINGS[key](name, _tensor_value(name, arr))
        elif name in dialects.TRTLLM_INPUTS:
            dialects.trtllm_value(name, arr, values)
        else:
            raise RequestError(name, f"is not an input of this model; inputs: {list(INPUTS)}")
    return values


def parse_request(
    request_id: str,
    tensors: Mapping[str, np.ndarray],
    parameters: Mapping[str, Any] | str | None,
    default_max_tokens: int,
    exclude_input_default: bool = True,
) -> ParsedRequest:
    """Build the engine request; raises RequestError naming the offending input.
    exclude_input_default: whether a non-streamed response leaves the prompt out when the
    request does not say (`exclude_input_in_output`)."""
    values = _settings(tensors, parameters)
    prompt = prompt_ids = None
    if "text_input" in tensors:
        prompt = as_str("text_input", _tensor_value("text_input", tensors["text_input"]))
    if "input_ids" in tensors:
        prompt_ids = [as_int("input_ids", x, 0, _INT32) for x in tensors["input_ids"].reshape(-1)]
    stop_ids = values.get("stop_token_ids", ())
    if "end_id" in values:
        stop_ids = (*stop_ids, values["end_id"])
    returns = frozenset(out for flag, out in dialects.RETURNS.items() if values.get(flag))
    logprobs = values.get("num_logprobs")
    if logprobs is None and returns & {"logprobs", "cumulative_logprob"}:
        logprobs = 0  # NOTE: the return_* flags alone ask for the sampled tokens' own
    sampling = SamplingParams(
        max_tokens=values.get("max_tokens", default_max_tokens),
        min_tokens=values.get("min_tokens", 0),
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        top_k=values.get("top_k", 0),
        seed=values.get("seed"),
        stop=values.get("stop", ()),
        stop_token_ids=stop_ids,
        ignore_eos=values.get("ignore_eos", False),
        n=values.get("n", 1),
        logprobs=logprobs,
        prompt_logprobs=values.get("prompt_logprobs"),
        guided=values.get("guided_decoding"),
    )
    stream = values.get("stream", False)
    exclude = values.get("exclude_input_in_output", exclude_input_default)
    return ParsedRequest(
        GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_ids=prompt_ids,
            sampling=sampling,
            hidden_mode=values.get("MODE", HiddenStatesMode.NONE),
            hidden_layers=values.get("hidden_layers"),
        ),
        stream=stream,
        echo=not exclude and not stream and prompt is not None,
        returns=returns,
        stream_interval=values.get("stream_interval"),
    )
