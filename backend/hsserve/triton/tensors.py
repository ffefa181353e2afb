"""Triton tensors <-> engine objects, with no Triton import: inputs arrive as a dict of numpy
arrays (and the request's parameters JSON), so parsing is testable and fuzzable on its own.

Precedence for each setting: typed input tensor > `sampling_parameters` JSON > request
parameters (e.g. extra fields of an HTTP generate body) > server default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from hsserve.request import (
    GenerationRequest,
    HiddenStatesMode,
    RequestError,
    SamplingParams,
)

INPUTS = (
    "text_input", "input_ids", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "ignore_eos", "n", "sampling_parameters", "MODE", "hidden_layers",
)
OUTPUTS = (
    "text_output", "output_ids", "HIDDEN_STATES", "finish_reason", "num_input_tokens",
    "num_output_tokens", "sequence_index",
)


def _as_int(name: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, float, np.floating)):
        raise RequestError(name, f"expected an integer, got {type(v).__name__} {v!r}")
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v) or v != int(v):
            raise RequestError(name, f"expected an integer, got {v!r}")
    iv = int(v)
    if not lo <= iv <= hi:
        raise RequestError(name, f"{iv} is outside {lo}..{hi}")
    return iv


def _as_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise RequestError(name, f"expected a number, got {type(v).__name__} {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise RequestError(name, f"expected a finite number, got {v!r}")
    return f


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise RequestError(name, f"expected true or false, got {v!r}")


def _as_str(name: str, v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(name, "is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise RequestError(name, f"expected a string, got {type(v).__name__} {v!r}")


def _as_str_list(name: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, (str, bytes)):
        return (_as_str(name, v),)
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(_as_str(name, x) for x in v)
    raise RequestError(name, f"expected a string or a list of strings, got {v!r}")


def _as_int_list(name: str, v: Any, lo: int, hi: int) -> tuple[int, ...]:
    if isinstance(v, (list, tuple, np.ndarray)):
        return tuple(_as_int(name, x, lo, hi) for x in v)
    return (_as_int(name, v, lo, hi),)


# Settings that may also come through the JSON / request parameters, with their parsers.
_SETTINGS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": lambda n, v: _as_int(n, v, 0, 2**31 - 1),
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": lambda n, v: _as_int(n, v, -1, 2**31 - 1),
    "seed": lambda n, v: _as_int(n, v, 0, 2**64 - 1),
    "stop": _as_str_list,
    "stop_token_ids": lambda n, v: _as_int_list(n, v, 0, 2**31 - 1),
    "ignore_eos": _as_bool,
    "n": lambda n, v: _as_int(n, v, 1, 2**31 - 1),
    "MODE": _as_str,
    "hidden_layers": lambda n, v: _as_int_list(n, v, -(2**31), 2**31 - 1),
    "stream": _as_bool,
}
_SCALAR_INPUTS = {
    "stream", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "n", "MODE",
    "text_input", "sampling_parameters",
}


@dataclass
class ParsedRequest:
    request: GenerationRequest
    stream: bool


def _json_settings(source: str, raw: Any) -> dict[str, Any]:
    if isinstance(raw, (bytes, str)):
        text = _as_str(source, raw)
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


def parse_request(
    request_id: str,
    tensors: Mapping[str, np.ndarray],
    parameters: Mapping[str, Any] | str | None,
    default_max_tokens: int,
) -> ParsedRequest:
    """Build the engine request; raises RequestError naming the offending input."""
    values: dict[str, Any] = {}
    # request parameters: unknown keys are ignored (Triton and clients add their own)
    params = _json_settings("parameters", parameters) if parameters else {}
    for key, v in params.items():
        if key in _SETTINGS:
            values[key] = _SETTINGS[key](key, v)
    if "sampling_parameters" in tensors:
        js = _json_settings("sampling_parameters", _tensor_value("sampling_parameters",
                                                                  tensors["sampling_parameters"]))
        unknown = sorted(set(js) - set(_SETTINGS))
        if unknown:
            raise RequestError(
                "sampling_parameters", f"unknown field(s) {unknown}; allowed: {sorted(_SETTINGS)}"
            )
        for key, v in js.items():
            values[key] = _SETTINGS[key](f"sampling_parameters.{key}", v)
    for name, arr in tensors.items():
        if name in ("text_input", "input_ids", "sampling_parameters"):
            continue
        if name not in _SETTINGS:
            raise RequestError(name, f"is not an input of this model; inputs: {list(INPUTS)}")
        values[name] = _SETTINGS[name](name, _tensor_value(name, arr))

    prompt = prompt_ids = None
    if "text_input" in tensors:
        prompt = _as_str("text_input", _tensor_value("text_input", tensors["text_input"]))
    if "input_ids" in tensors:
        prompt_ids = [_as_int("input_ids", x, 0, 2**31 - 1) for x in tensors["input_ids"].reshape(-1)]
    sampling = SamplingParams(
        max_tokens=values.get("max_tokens", default_max_tokens),
        temperature=values.get("temperature", 1.0),
        top_p=values.get("top_p", 1.0),
        top_k=values.get("top_k", 0),
        seed=values.get("seed"),
        stop=values.get("stop", ()),
        stop_token_ids=values.get("stop_token_ids", ()),
        ignore_eos=values.get("ignore_eos", False),
        n=values.get("n", 1),
    )
    return ParsedRequest(
        GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_ids=prompt_ids,
            sampling=sampling,
            hidden_mode=values.get("MODE", HiddenStatesMode.NONE),
            hidden_layers=values.get("hidden_layers", (-1,)),
        ),
        stream=values.get("stream", False),
    )

