"""Responses: a delta as Triton's InferenceResponse (only the outputs the request named), or the
error response that ends a request. `pb` is triton_python_backend_utils (a stand-in in tests)."""

from __future__ import annotations

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
    def __init__(self, pb):
        self.pb = pb

    def for_delta(self, delta: Delta, outputs: frozenset, shutting_down: bool = False):
        """The response for `delta`: its outputs among `outputs`, or the request's error."""
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
        if delta.finished:
            if "finish_reason" in outputs:
                tensors.append(self._strings("finish_reason", [delta.finish_reason.value]))
            for name in ("num_input_tokens", "num_output_tokens"):
                if name in outputs:
                    tensors.append(self._numbers(name, [getattr(delta, name)], np.uint32))
        return pb.InferenceResponse(output_tensors=tensors)

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
