"""Bytes on the wire and end-to-end latency of hidden states: MODE=last vs full, 128- and
1,000-token prompts, unary gRPC and HTTP (binary tensor data), through llm_sync.

Each call sends a fresh random prompt (so the prefix cache never helps one mode over the other),
max_tokens=1, hidden_layers=[-1] (576 float32 per row on SmolLM2). Response bytes: the gRPC
ModelInferResponse's serialized size; the HTTP response body (JSON header + binary tensors).
Latency: median of --repeats calls, client side.

    python bench/payload.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

from hsserve.triton.server import start_server  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..", "model_repository")
OUTPUTS = ("text_output", "output_ids", "HIDDEN_STATES", "finish_reason", "num_input_tokens",
           "num_output_tokens")


def inputs(module, ids: list[int], mode: str):
    out = []
    for name, arr, dtype in (("input_ids", np.array(ids, np.int32), "INT32"),
                             ("max_tokens", np.array([1], np.int32), "INT32"),
                             ("MODE", np.array([mode.encode()], np.object_), "BYTES"),
                             ("hidden_layers", np.array([-1], np.int32), "INT32")):
        i = module.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


def grpc_call(url: str, ids: list[int], mode: str) -> tuple[float, int, tuple]:
    client = grpcclient.InferenceServerClient(url)
    t0 = time.perf_counter()
    result = client.infer("llm_sync", inputs(grpcclient, ids, mode))
    dt = time.perf_counter() - t0
    client.close()
    return dt, result.get_response().ByteSize(), result.as_numpy("HIDDEN_STATES").shape


def http_call(url: str, ids: list[int], mode: str) -> tuple[float, int, tuple]:
    outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in OUTPUTS]
    body, json_size = httpclient.InferenceServerClient.generate_request_body(
        inputs(httpclient, ids, mode), outputs=outs)
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    headers = {"Content-Type": "application/octet-stream",
               "Inference-Header-Content-Length": str(json_size)}
    t0 = time.perf_counter()
    conn.request("POST", "/v2/models/llm_sync/infer", body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    dt = time.perf_counter() - t0
    assert resp.status == 200, data[:200]
    header_len = resp.getheader("Inference-Header-Content-Length")
    result = httpclient.InferenceServerClient.parse_response_body(
        data, header_length=int(header_len) if header_len else None)
    conn.close()
    return dt, len(data), result.as_numpy("HIDDEN_STATES").shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1000])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "payload_cpu.json"))
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    server = start_server(os.path.abspath(REPO), log_path=os.path.join(root, "server.log"))
    rng = np.random.default_rng(0)
    rows = []
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_sync"))
        grpc_call(server.grpc_url, [5, 6, 7], "last")  # warm-up
        for length in args.lengths:
            for mode in ("last", "full"):
                for proto, call, url in (("grpc", grpc_call, server.grpc_url),
                                         ("http", http_call, server.http_url)):
                    times, sizes, shape = [], [], None
                    for _ in range(args.repeats):
                        ids = rng.integers(100, 49000, length).tolist()
                        dt, size, shape = call(url, ids, mode)
                        times.append(dt)
                        sizes.append(size)
                    row = {"prompt_tokens": length, "mode": mode, "protocol": proto,
                           "hidden_shape": list(shape), "response_bytes": int(statistics.median(sizes)),
                           "latency_ms_p50": round(1000 * statistics.median(times), 1)}
                    print(row, flush=True)
                    rows.append(row)
    finally:
        server.stop()
    write_result(args.out, {"benchmark": "hidden_state_payload", "model": "SmolLM2-135M-Instruct",
                            "dtype": "float32", "max_tokens": 1, "hidden_layers": [-1],
                            "repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
