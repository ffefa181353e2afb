"""Other Triton LLM backends' request dialects, translated once into ours (nothing past the
parser knows which dialect a request came in).

- vllm_backend: `sampling_parameters` (and request parameters) carry numbers and booleans as
  JSON strings ({"max_tokens": "256"}); `exclude_input_in_output`; the `return_*` flags.
- TensorRT-LLM backend (genai-perf `--backend tensorrtllm`, Triton's OpenAI frontend): typed
  `min_length`, `stop_words`, `random_seed`, `end_id`, `pad_id`, `bad_words`, `beam_width`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hsserve.request import RequestError
from hsserve.triton.values import as_int, as_str

# vllm_backend's return_* inputs -> the output each adds to every response
RETURNS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
}
_NUMBER_KINDS = {
    "max_tokens": int, "min_tokens": int, "top_k": int, "seed": int, "n": int, "num_logprobs": int,
    "prompt_logprobs": int, "stream_interval": int,
    "temperature": float, "top_p": float, "ignore_eos": bool, "stream": bool,
    "exclude_input_in_output": bool, **dict.fromkeys(RETURNS, bool),
}
# TensorRT-LLM input names that are ours under another name
TRTLLM_RENAMES = {"min_length": "min_tokens", "stop_words": "stop", "random_seed": "seed"}
TRTLLM_INPUTS = ("min_length", "stop_words", "random_seed", "end_id", "pad_id", "bad_words",
                 "beam_width")


def unstring(name: str, key: str, v: Any) -> Any:
    """A JSON value as vllm_backend reads it: a string given for a number or a boolean is parsed
    (int("256"), float("0.1"), "true" / "false"); any other string is left for the typed parser
    to refuse, naming `name`."""
    kind = _NUMBER_KINDS.get(key)
    if kind is None or not isinstance(v, str):
        return v
    text = v.strip()
    try:
        if kind is bool:
            if text.lower() in ("true", "false"):
                return text.lower() == "true"
            raise ValueError
        return kind(text)
    except ValueError:
        what = {int: "an integer", float: "a number", bool: "true or false"}[kind]
        raise RequestError(name, f"expected {what} (or a string of one), got {v!r}") from None


def trtllm_value(name: str, value: np.ndarray, values: dict[str, Any]) -> None:
    """The TensorRT-LLM inputs with no name of ours: end_id stops like an EOS id, pad_id is
    not needed (no padded batches), bad_words and beam search are not supported."""
    flat = value.reshape(-1)
    if name == "end_id":
        if flat.size != 1:
            raise RequestError(name, f"expected one token id, got shape {list(value.shape)}")
        values["end_id"] = as_int(name, flat[0], 0, 2**31 - 1)
    elif name == "bad_words":
        if any(as_str(name, w) for w in flat):
            raise RequestError(name, "is not supported (only empty); use stop_words to end on words")
    elif name == "beam_width":
        if flat.size != 1 or as_int(name, flat[0], 1, 2**31 - 1) != 1:
            raise RequestError(name, f"{flat.tolist()!r}: beam search is not supported; allowed: 1")
