"""Soak: many requests with random MODEs, lengths and streaming, some cancelled mid-flight, some
malformed, against a running tritonserver; then the server must be idle and its memory flat.

run_soak() is also what tests/integration/test_soak.py runs (CI). Standalone, this starts a
server on the repository and writes results/soak_cpu.json:

    python bench/soak.py [--requests 1000]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter

import numpy as np
import tritonclient.grpc as grpcclient

MALFORMED = [  # fields, the input its error must name
    (dict(text_input="x", MODE="middle"), "MODE"),
    (dict(text_input="x", input_ids=[1, 2]), "text_input"),
    (dict(text_input="x", max_tokens=5000), "max_tokens"),
    (dict(text_input="x", sampling_parameters="{oops"), "sampling_parameters"),
    (dict(text_input="x", hidden_layers=[99], MODE="last"), "hidden_layers"),
    (dict(text_input="x", top_p=0.0), "top_p"),
]
TYPES = {"text_input": (np.object_, "BYTES"), "input_ids": (np.int32, "INT32"),
         "stream": (np.bool_, "BOOL"), "max_tokens": (np.int32, "INT32"),
         "temperature": (np.float32, "FP32"), "top_p": (np.float32, "FP32"),
         "seed": (np.uint64, "UINT64"), "ignore_eos": (np.bool_, "BOOL"),
         "sampling_parameters": (np.object_, "BYTES"), "MODE": (np.object_, "BYTES"),
         "hidden_layers": (np.int32, "INT32")}


def _inputs(fields: dict):
    out = []
    for name, value in fields.items():
        dtype, triton = TYPES[name]
        values = list(value) if isinstance(value, list) else [value]
        if dtype is np.object_:
            values = [v.encode() for v in values]
        arr = np.array(values, dtype=dtype)
        inp = grpcclient.InferInput(name, list(arr.shape), triton)
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def server_rss_mb(pgid: int) -> float:
    """Resident memory of every process in the server's process group (tritonserver + stubs)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ProcessLookupError):
            continue
    return total / 1024


def metric(url: str, name: str, model: str = "llm") -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'model="{model}"' in line)


def one_request(url: str, kind: str, fields: dict, cancel_after: int, expect: str | None,
                headers: dict | None = None, timeout: float = 300.0) -> dict:
    """Send one request on its own stream (gRPC metadata `headers`); returns what happened and
    when it went out and ended (t_sent, t_done: time.time())."""
    q: list = []
    done = threading.Event()

    def callback(result, error):
        q.append((result, error))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    out = {"kind": kind, "ids": [], "rows": [], "error": None, "fields": fields, "retries": 0}
    for _ in range(3):
        client = grpcclient.InferenceServerClient(url)
        client.start_stream(callback=callback, headers=headers)
        try:
            out["t_sent"] = time.time()
            client.async_stream_infer("llm", _inputs(fields), enable_empty_final_response=True)
            break
        except grpcclient.InferenceServerException:
            # NOTE: seen rarely on this 2-core machine: a new stream fails before the request
            # goes out (its callback has the reason); a client retries on a fresh stream
            out["retries"] += 1
            out["stream_errors"] = [e.message() for _, e in q if e is not None]
            q.clear()
            done.clear()
            client.close()
            time.sleep(0.1)
    if kind == "cancelled":
        deadline = time.time() + 30
        while len(q) < cancel_after and not done.is_set() and time.time() < deadline:
            time.sleep(0.005)
        out["responses"] = len(q)  # NOTE: 0: it may be cancelled before it reached the server
        client.stop_stream(cancel_requests=True)
        client.close()
        out["t_done"] = time.time()
        return out
    done.wait(timeout)
    out["t_done"] = time.time()
    client.stop_stream()
    client.close()
    for result, error in q:
        if error is not None:
            out["error"] = error.message()
            continue
        ids = result.as_numpy("output_ids")
        if ids is not None:
            out["ids"] += ids.tolist()
        rows = result.as_numpy("HIDDEN_STATES")
        if rows is not None:
            out["rows"].append(rows)
    if not done.is_set():
        out["error"] = f"no final response within {timeout:g} s"
    return out


def plan(num: int, seed: int) -> list[tuple[str, dict, int, str | None]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(num):
        r = rng.random()
        if r < 0.05:
            fields, name = MALFORMED[i % len(MALFORMED)]
            jobs.append(("malformed", {**fields, "stream": rng.random() < 0.5}, 0, name))
            continue
        fields = {
            "input_ids": [rng.randint(100, 40000) for _ in range(rng.randint(1, 40))],
            "max_tokens": rng.randint(0, 12),
            "MODE": rng.choice(["none", "last", "full"]),
            "stream": rng.random() < 0.6,
            "temperature": rng.choice([0.0, 0.0, 0.8]),
            "seed": i,
            "ignore_eos": True,
        }
        kind = "cancelled" if r < 0.25 else "valid"
        if kind == "cancelled":
            fields.update(stream=True, max_tokens=rng.randint(20, 60))
        jobs.append((kind, fields, rng.randint(0, 3), None))
    return jobs


def run_soak(grpc_url: str, metrics_url: str, pgid: int, num: int = 1000, seed: int = 0,
             concurrency: int = 16, warmup: int = 100, trace_every: int = 0) -> dict:
    """trace_every > 0: also the server's RSS after every that many requests past the warm-up."""
    jobs = plan(num, seed)
    results: list[dict] = []
    rss: dict[str, float] = {}
    trace: list[tuple[int, float]] = []
    step = trace_every or num
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(one_request, grpc_url, kind, fields, k, expect)
                   for kind, fields, k, expect in jobs[:warmup]]
        results += [f.result() for f in futures]
        rss["after_warmup_mb"] = server_rss_mb(pgid)
        for start in range(warmup, num, step):
            futures = [pool.submit(one_request, grpc_url, kind, fields, k, expect)
                       for kind, fields, k, expect in jobs[start : start + step]]
            results += [f.result() for f in futures]
            if trace_every:
                trace.append((len(results), round(server_rss_mb(pgid), 1)))
    deadline = time.time() + 15
    while time.time() < deadline and (metric(metrics_url, "llm_requests_running")
                                      or metric(metrics_url, "llm_kv_blocks_in_use")):
        time.sleep(0.2)
    rss["after_mb"] = server_rss_mb(pgid)
    errors = Counter()
    for (kind, fields, _, expect), res in zip(jobs, results):
        if kind == "malformed":
            ok = res["error"] is not None and expect in res["error"]
            errors["malformed_named" if ok else "malformed_unclear"] += 1
        elif kind == "valid":
            errors["valid_ok" if res["error"] is None and len(res["ids"]) == fields["max_tokens"]
                   else "valid_failed"] += 1
    stream_errors = Counter(m for r in results for m in r.get("stream_errors", []))
    return {
        "requests": dict(Counter(k for k, *_ in jobs)),
        "stream_retries": sum(r["retries"] for r in results),
        "stream_errors": dict(stream_errors),
        "outcomes": dict(errors),
        "kv_blocks_in_use_after": metric(metrics_url, "llm_kv_blocks_in_use"),
        "requests_running_after": metric(metrics_url, "llm_requests_running"),
        "rss": {k: round(v, 1) for k, v in rss.items()},
        **({"rss_trace_mb": trace} if trace_every else {}),
        "results": results,
        "jobs": jobs,
    }


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from common import write_result

    from hsserve.triton.server import start_server

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--trace-every", type=int, default=0, help="RSS after every N requests")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "soak_cpu.json"))
    args = ap.parse_args()
    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model_repository")
    server = start_server(repo, log_path=os.path.join(tempfile.mkdtemp(), "server.log"))
    try:
        server.wait_ready(timeout=600, models=("llm",))
        t0 = time.time()
        out = run_soak(server.grpc_url, f"http://127.0.0.1:{server.ports.metrics}/metrics",
                       os.getpgid(server.process.pid), args.requests, trace_every=args.trace_every)
        wall = time.time() - t0
    finally:
        server.stop()
    out.pop("results")
    out.pop("jobs")
    write_result(args.out, {"benchmark": "soak", "wall_s": round(wall, 1), **out})
    print(out)


if __name__ == "__main__":
    main()
