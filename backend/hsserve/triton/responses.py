"""Responses: a delta as Triton's InferenceResponse (only the outputs the request named), or the
error response that ends a request. `pb` is triton_python_backend_utils (a stand-in in tests)."""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import torch

from hsserve.request import Delta, FinishReason
from hsserve.triton.tensors import OUTPUTS

ALL_OUTPUTS = frozenset(OUTPUTS)


def requested_outputs(request) -> frozenset:
    """The outputs a request asked for, all when it named none: Triton drops the others anyway,
    and not building them spares the stub's GIL (bench/README.md#requested-outputs)."""
    return ALL_OUTPUTS.intersection(request.requested_output_names()) or ALL_OUTPUTS


class Responses:
    def __init__(self, pb, decode: Callable[[int], str] | None = None):
        """decode: a token id's text (vllm_backend's `logprobs` JSON names each token)."""
        self.pb, self.decode = pb, decode or str

    def for_delta(self, delta: Delta, outputs: frozenset, shutting_down: bool = False,
                  returns: frozenset = frozenset()):
        """The response for `delta`: its outputs among `outputs`, or the request's error.
        `returns` (vllm_backend's return_* flags): finish_reason and num_input_tokens on every
        response ("None" before the end), num_output_tokens counting this response's tokens."""
        pb = self.pb
        if delta.finish_reason == FinishReason.CANCELLED:
            return self.error("the request was cancelled", pb.TritonError.CANCELLED)
        if delta.finish_reason == FinishReason.ERROR:
            code = pb.TritonError.UNAVAILABLE if shutting_down else pb.TritonError.INTERNAL
            return self.error(delta.error or "the engine failed", code)
        tensors = []
        if "text_output" in outputs:
            tensors.append(self._strings("text_output", [delta.text]))
        if "output_ids" in outputs:
            tensors.append(self._numbers("output_ids", delta.token_ids, np.int32))
        if "sequence_index" in outputs:
            tensors.append(self._numbers("sequence_index", [delta.sequence_index], np.uint32))
        if delta.hidden is not None and "HIDDEN_STATES" in outputs:  # NOTE: absent when no rows
            tensors.append(self._dlpack("HIDDEN_STATES", delta.hidden))
        if delta.logprobs is not None:
            tensors += self._logprobs(delta, outputs, returns)
        if delta.prompt_logprobs is not None:
            tensors += self._prompt_logprobs(delta.prompt_logprobs, outputs)
        final = delta.finished
        if "finish_reason" in outputs and (final or "finish_reason" in returns):
            reason = delta.finish_reason.value if final else "None"
            tensors.append(self._strings("finish_reason", [reason]))
        if "num_input_tokens" in outputs and (final or "num_input_tokens" in returns):
            tensors.append(self._numbers("num_input_tokens", [delta.num_input_tokens], np.uint32))
        if "num_output_tokens" in outputs and (final or "num_output_tokens" in returns):
            count = len(delta.token_ids) if "num_output_tokens" in returns else \
                delta.num_output_tokens
            tensors.append(self._numbers("num_output_tokens", [count], np.uint32))
        return pb.InferenceResponse(output_tensors=tensors)

    def _logprobs(self, delta: Delta, outputs: frozenset, returns: frozenset) -> list:
        """output_logprobs [tokens], top_logprob_ids / top_logprobs [tokens, k] (k > 0), and
        vllm_backend's cumulative_logprob and `logprobs` JSON when its flags ask."""
        entries, out = delta.logprobs, []
        if "output_logprobs" in outputs:
            values = np.asarray([e.logprob for e in entries], dtype=np.float32)
            out.append(self.pb.Tensor("output_logprobs", values))
        k = len(entries[0].top_ids) if entries else 0
        if k and "top_logprob_ids" in outputs:
            ids = np.asarray([e.top_ids for e in entries], dtype=np.int32)
            out.append(self.pb.Tensor("top_logprob_ids", ids))
        if k and "top_logprobs" in outputs:
            values = np.asarray([e.top_logprobs for e in entries], dtype=np.float32)
            out.append(self.pb.Tensor("top_logprobs", values))
        if "cumulative_logprob" in returns and "cumulative_logprob" in outputs:
            out.append(self.pb.Tensor("cumulative_logprob",
                                      np.asarray([delta.cumulative_logprob], dtype=np.float32)))
        if "logprobs" in returns and "logprobs" in outputs:
            out.append(self._strings("logprobs", [json.dumps(self._vllm_json(delta))]))
        return out

    def _prompt_logprobs(self, entries: list, outputs: frozenset) -> list:
        """prompt_token_logprobs [prompt tokens] (NaN for the first: nothing precedes it),
        prompt_top_logprob_ids / prompt_top_logprobs [prompt tokens, k] (k > 0; -1 / NaN first)."""
        k = len(entries[-1].top_ids) if len(entries) > 1 else 0
        nan, out = float("nan"), []
        if "prompt_token_logprobs" in outputs:
            values = [nan if e is None else e.logprob for e in entries]
            out.append(self.pb.Tensor("prompt_token_logprobs", np.asarray(values, np.float32)))
        if k and "prompt_top_logprob_ids" in outputs:
            ids = [[-1] * k if e is None else e.top_ids for e in entries]
            out.append(self.pb.Tensor("prompt_top_logprob_ids", np.asarray(ids, np.int32)))
        if k and "prompt_top_logprobs" in outputs:
            values = [[nan] * k if e is None else e.top_logprobs for e in entries]
            out.append(self.pb.Tensor("prompt_top_logprobs", np.asarray(values, np.float32)))
        return out

    def _vllm_json(self, delta: Delta) -> list[dict]:
        """Per token {token id: {logprob, rank, decoded_token}}: the sampled token, then the
        top alternatives (vllm_backend's form)."""
        out = []
        for token, e in zip(delta.token_ids, delta.logprobs):
            d = {token: {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.decode(token)}}
            for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs), start=1):
                d.setdefault(t, {"logprob": v, "rank": r, "decoded_token": self.decode(t)})
            out.append(d)
        return out

    def error(self, message: str, code=None):
        pb = self.pb
        err = pb.TritonError(message) if code is None else pb.TritonError(message, code)
        return pb.InferenceResponse(error=err)

    def _dlpack(self, name: str, value: torch.Tensor):
        """Rows through DLPack: bfloat16 has no numpy dtype; no copy."""
        return self.pb.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))

    def _numbers(self, name: str, values: list[int], dtype):
        """Small integer outputs from numpy: cheaper in the stub than torch + DLPack
        (bench/README.md#small-outputs)."""
        return self.pb.Tensor(name, np.asarray(values, dtype=dtype))

    def _strings(self, name: str, values: list[str]):
        return self.pb.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))
