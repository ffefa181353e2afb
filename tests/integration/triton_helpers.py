"""Talking to the real server in tests: typed inputs, gRPC streams, unary calls, metrics."""

from __future__ import annotations

import json
import queue
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
try:
    import tritonclient.http as httpclient
except (ImportError, RuntimeError):  # NOTE: a gRPC-only client (the GPU benchmark machine)
    httpclient = None
from tritonclient.utils import np_to_triton_dtype

TYPES = {
    "text_input": np.object_, "input_ids": np.int32, "stream": np.bool_, "max_tokens": np.int32,
    "temperature": np.float32, "top_p": np.float32, "top_k": np.int32, "seed": np.uint64,
    "stop": np.object_, "stop_token_ids": np.int32, "ignore_eos": np.bool_, "n": np.int32,
    "sampling_parameters": np.object_, "MODE": np.object_, "hidden_layers": np.int32,
    "min_tokens": np.int32, "exclude_input_in_output": np.bool_, "return_finish_reason": np.bool_,
    "return_cumulative_logprob": np.bool_, "return_logprobs": np.bool_,
    "return_num_input_tokens": np.bool_, "return_num_output_tokens": np.bool_,
    "min_length": np.int32, "stop_words": np.object_, "random_seed": np.uint64,
    "end_id": np.int32, "pad_id": np.int32, "bad_words": np.object_, "beam_width": np.int32,
    "num_logprobs": np.int32, "prompt_logprobs": np.int32,
}
LIST_INPUTS = {"input_ids", "stop", "stop_token_ids", "hidden_layers", "stop_words", "bad_words"}


def arrays(fields: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, value in fields.items():
        values = list(value) if name in LIST_INPUTS else [value]
        dtype = TYPES[name]
        if dtype is np.object_:
            values = [v.encode() if isinstance(v, str) else v for v in values]
        out[name] = np.array(values, dtype=dtype)
    return out


def infer_inputs(module, fields: dict, raw: dict[str, np.ndarray] | None = None):
    inputs = []
    for name, arr in {**arrays(fields), **(raw or {})}.items():
        inp = module.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


@dataclass
class Streamed:
    responses: list[dict[str, np.ndarray]] = field(default_factory=list)
    error: Exception | None = None

    def cat(self, name: str):
        parts = [r[name] for r in self.responses if r.get(name) is not None]
        if not parts:
            return None
        if name == "text_output":
            return b"".join(b for p in parts for b in p.reshape(-1)).decode()
        return np.concatenate(parts)

    def final(self, name: str):
        return self.responses[-1].get(name)


OUTPUT_NAMES = ("text_output", "output_ids", "HIDDEN_STATES", "finish_reason", "num_input_tokens",
                "num_output_tokens", "sequence_index", "output_logprobs", "top_logprob_ids",
                "top_logprobs", "cumulative_logprob", "logprobs", "prompt_token_logprobs",
                "prompt_top_logprob_ids", "prompt_top_logprobs")
CLASSIFIER_OUTPUTS = ("text_output", "output_ids", "PROBABILITIES", "LABEL")


def outputs_of(model: str) -> tuple[str, ...]:
    return CLASSIFIER_OUTPUTS if model == "llm_classifier" else OUTPUT_NAMES


def _as_dict(result, names=OUTPUT_NAMES) -> dict[str, np.ndarray]:
    return {n: result.as_numpy(n) for n in names}


class GrpcStream:
    """One gRPC stream: send requests, read their responses until each is final."""

    def __init__(self, url: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.queue: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.queue.put((result, error)))

    def send(self, fields: dict, request_id: str = "", model: str = "llm", raw=None,
             outputs: tuple[str, ...] = (), parameters: dict | None = None) -> None:
        """outputs: the outputs the request names (none: all); parameters: request parameters."""
        asked = [grpcclient.InferRequestedOutput(n) for n in outputs] or None
        self.client.async_stream_infer(model, infer_inputs(grpcclient, fields, raw),
                                       outputs=asked, request_id=request_id,
                                       enable_empty_final_response=True, parameters=parameters)

    def read(self, timeout: float = 300.0, first_only: bool = False) -> Streamed:
        """Responses of one request (the stream carries one request at a time here); first_only:
        return after the first response that carries data."""
        out = Streamed()
        while True:
            result, error = self.queue.get(timeout=timeout)
            if error is not None:
                out.error = error
                return out
            response = result.get_response()
            data = {n: result.as_numpy(n) for n in OUTPUT_NAMES + CLASSIFIER_OUTPUTS}
            if any(v is not None for v in data.values()):
                out.responses.append(data)
                if first_only:
                    return out
            if response.parameters["triton_final_response"].bool_param:
                return out

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def stream_once(url: str, fields: dict, raw=None, model: str = "llm",
                outputs: tuple[str, ...] = (), parameters: dict | None = None) -> Streamed:
    s = GrpcStream(url)
    try:
        s.send({"stream": True, **fields} if "stream" not in fields else fields, raw=raw,
               model=model, outputs=outputs, parameters=parameters)
        return s.read()
    finally:
        s.close()


def unary_http(url: str, fields: dict, model: str = "llm_sync"):
    client = httpclient.InferenceServerClient(url)
    names = outputs_of(model)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in names]
    return _as_dict(client.infer(model, infer_inputs(httpclient, fields), outputs=outputs), names)


def unary_grpc(url: str, fields: dict, model: str = "llm_sync"):
    client = grpcclient.InferenceServerClient(url)
    return _as_dict(client.infer(model, infer_inputs(grpcclient, fields)), outputs_of(model))


def metrics(http_metrics_url: str, model: str | None = None,
            prefixes: tuple[str, ...] = ("llm_",)) -> dict[str, float]:
    """Our metrics (llm_*; or the series named by `prefixes`, e.g. Triton's nv_inference_),
    summed over labels, or those of one model; histograms appear as their _count and _sum
    (buckets are left out)."""
    text = urllib.request.urlopen(http_metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefixes) or "_bucket{" in line:
            continue
        if model is not None and f'model="{model}"' not in line:
            continue
        name = line.split("{")[0].split(" ")[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def http_generate(url: str, model: str, body: dict, stream: bool = False):
    """POST /v2/models/<model>/generate[_stream]; returns (status, json or list of events)."""
    path = "generate_stream" if stream else "generate"
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{path}",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())
    if stream:
        return status, [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
    return status, json.loads(text)


def stub_processes(marker: str) -> list[str]:
    """Python-backend stubs still running whose command line holds `marker` (each server's stubs
    run from its own backend dir)."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=False)
    return [p for p in ps.stdout.splitlines() if "triton_python_backend_stub" in p and marker in p]


def stub_children(marker: str) -> list[int]:
    """Pids of processes the stubs of this server started (the engine processes, multiprocessing's
    resource tracker)."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True, check=False)
    rows = [line.split(None, 2) for line in ps.stdout.splitlines()[1:]]
    stubs = {r[0] for r in rows if len(r) == 3 and "triton_python_backend_stub" in r[2] and marker in r[2]}
    return [int(r[0]) for r in rows if len(r) == 3 and r[1] in stubs]


def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    left.append(pid)
        except OSError:
            pass
    return left
