"""TritonPythonModel for `llm_sync`: a unary front over the decoupled `llm` model.

Triton refuses unary infer() on decoupled models; this model forwards each request to `llm`
through BLS (decoupled exec, stream forced off), gathers its responses and answers once with
the same outputs. It holds no weights.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from hsserve.request import RequestError
from hsserve.triton.tensors import INPUTS, OUTPUTS, parse_request

pb_utils = None  # NOTE: bound in initialize()
_TARGET = "llm"
_FINAL_ONLY = ("num_input_tokens", "num_output_tokens", "sequence_index", "cumulative_logprob")


def _join(name: str, tensors: list):
    """Concatenate one output over the responses (strings joined, rows stacked)."""
    if name == "text_output":
        text = b"".join(b for t in tensors for b in t.as_numpy().reshape(-1))
        return pb_utils.Tensor(name, np.array([text], dtype=np.object_))
    if name == "logprobs":  # NOTE: vllm_backend's JSON list per response: one list
        items = [e for t in tensors for e in json.loads(t.as_numpy().reshape(-1)[0])]
        return pb_utils.Tensor(name, np.array([json.dumps(items).encode()], dtype=np.object_))
    if len(tensors) == 1:
        return pb_utils.Tensor.from_dlpack(name, tensors[0].to_dlpack())
    parts = [torch.utils.dlpack.from_dlpack(t.to_dlpack()) for t in tensors]
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(torch.cat(parts)))


_DEFAULT_TYPES = {"MODE": np.object_, "hidden_layers": np.int32, "max_tokens": np.int32,
                  "temperature": np.float32}


def _default_inputs(values: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, value in values.items():
        if name not in _DEFAULT_TYPES:
            raise ValueError(f"default_inputs: {name!r} not supported; allowed: {sorted(_DEFAULT_TYPES)}")
        items = value if isinstance(value, list) else [value]
        if _DEFAULT_TYPES[name] is np.object_:
            items = [str(v).encode() for v in items]
        out[name] = np.array(items, dtype=_DEFAULT_TYPES[name])
    return out


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        global pb_utils
        import triton_python_backend_utils as _pb

        pb_utils = _pb
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.target = params.get("target_model", _TARGET)
        # NOTE: inputs this front adds when a request lacks them (llm_sync_last: MODE=last for
        # the classifier ensemble; an ensemble cannot feed constant inputs itself)
        self.defaults = _default_inputs(json.loads(params.get("default_inputs", "") or "{}"))

    def execute(self, requests):
        return [self._forward(r) for r in requests]

    def _forward(self, request):
        given = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in INPUTS) if t is not None]
        try:
            n = parse_request("sync", {t.name(): t.as_numpy() for t in given}, request.parameters(),
                              0).request.sampling.n
        except RequestError:
            n = 1  # NOTE: llm answers the bad input itself, naming it
        if n != 1:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"n: {n}; this unary model answers with one completion (n = 1); send n > 1 to "
                f"the decoupled {self.target} model, whose responses carry sequence_index",
                pb_utils.TritonError.INVALID_ARG))
        inputs = [t for t in given if t.name() != "stream"]
        names = {t.name() for t in given}
        inputs += [pb_utils.Tensor(k, v) for k, v in self.defaults.items() if k not in names]
        inputs.append(pb_utils.Tensor("stream", np.array([False])))
        bls = pb_utils.InferenceRequest(
            model_name=self.target,
            requested_output_names=list(OUTPUTS),
            inputs=inputs,
            parameters=json.loads(request.parameters() or "{}"),
        )
        gathered: dict[str, list] = {}
        for response in bls.exec(decoupled=True):
            if response.has_error():
                return pb_utils.InferenceResponse(error=response.error())
            for t in response.output_tensors():
                gathered.setdefault(t.name(), []).append(t)
        if not gathered:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"{self.target} returned no outputs"))
        outputs = []
        for name, ts in gathered.items():
            if name == "finish_reason":
                outputs.append(pb_utils.Tensor(name, ts[-1].as_numpy()))
            elif name in _FINAL_ONLY:
                outputs.append(pb_utils.Tensor.from_dlpack(name, ts[-1].to_dlpack()))
            else:
                outputs.append(_join(name, ts))
        return pb_utils.InferenceResponse(output_tensors=outputs)
