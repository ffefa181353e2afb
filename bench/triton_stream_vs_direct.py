"""gRPC streaming through tritonserver vs the engine called directly, same machine, same run.

For concurrency 1, 8 and 32 (default): tokens/s, TTFT p50/p99 and inter-token latency p50/p99, for
the engine in this process (a consumer thread per request, or sinks), the engine in a child process
as the adapter runs it (engine/process.py, sinks), and gRPC streams through tritonserver.
Each request: a ~30-token prompt, 64 new tokens (EOS ignored), greedy, MODE=none. The engine
runs first in this process and is shut down; then the server starts on the repository.
--shape (GPU): a benchmark shape with random bf16 weights (bench/shapes.py) served from a copy of
the llm model folder; prompts are 32 random token ids (input_ids); gRPC clients run in
--client-procs processes so that the Python client is not what is measured (--client-cpus: on
CPUs of their own). Each client thread keeps one gRPC stream for its requests (--streams).

    python bench/triton_stream_vs_direct.py [--concurrency 1 8 32] [--requests 64]
    python bench/triton_stream_vs_direct.py --shape llama-1b --concurrency 64 --requests 1536 \
        --new 256 --client-procs 8 --client-cpus 6 --out bench/results/h200_triton.json
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from common import write_result  # noqa: E402

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hsserve.engine.process import EngineProcess  # noqa: E402
from hsserve.triton.server import start_server  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..", "model_repository")


def prompt(i: int) -> str:
    return f"Request {i}: write a short story about a lighthouse keeper and the sea at night."


def prompt_ids(i: int) -> list[int]:
    return [(i * 7919 + j * 104729) % 120000 + 10 for j in range(32)]


def gpu_repository(folder: str, root: str, params: dict[str, str], gpus: list[int] = ()) -> str:
    """A repository holding only a copy of the llm model serving `folder` (random weights unless
    it is "default"), with `params` set; with `gpus`, one instance (one engine) on each."""
    dst = os.path.join(root, "llm")
    shutil.copytree(os.path.join(REPO, "llm"), dst)
    random = {} if folder == "default" else {"load_format": "dummy", "dtype": "bfloat16"}
    cfg = os.path.join(dst, "config.pbtxt")
    set_params(cfg, {"model": folder} | random | params)
    if gpus:
        text = open(cfg).read()
        group = "instance_group [{ count: 1, kind: KIND_MODEL }]"
        assert group in text
        open(cfg, "w").write(text.replace(group, "instance_group [{ count: 1, kind: KIND_GPU, "
                                          f"gpus: [{', '.join(map(str, gpus))}] }}]"))
    return root


def set_params(path: str, params: dict[str, str]) -> None:
    """Set (or add) string parameters of a config.pbtxt."""
    text = open(path).read()
    for key, value in params.items():
        text, n = re.subn(r'key: "%s", value: \{ string_value: "[^"]*" \}' % key,
                          f'key: "{key}", value: {{ string_value: "{value}" }}', text)
        if not n:
            text = text.replace("parameters [", f'parameters [\n  {{ key: "{key}", value: {{ string_value: "{value}" }} }},')
    open(path, "w").write(text)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


class Timing:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.latency: list[float] = []  # NOTE: start -> the last response carrying tokens
        self.tokens = 0

    def record(self, start: float, arrivals: list[tuple[float, int]]) -> None:
        """arrivals: (time, tokens in that response) for responses carrying tokens."""
        with self.lock:
            self.ttft.append(arrivals[0][0] - start)
            self.latency.append(arrivals[-1][0] - start)
            for (t0, _), (t1, k) in zip(arrivals, arrivals[1:]):
                self.itl += [(t1 - t0) / k] * k
            self.tokens += sum(k for _, k in arrivals)

    def summary(self, wall: float) -> dict:
        return {
            "tok_s": round(self.tokens / wall, 1),
            "ttft_p50_ms": round(percentile(self.ttft, 50) * 1e3, 1),
            "ttft_p99_ms": round(percentile(self.ttft, 99) * 1e3, 1),
            "itl_p50_ms": round(percentile(self.itl, 50) * 1e3, 1),
            "itl_p99_ms": round(percentile(self.itl, 99) * 1e3, 1),
            "ttft_mean_ms": _ms(self.ttft),
            "latency_mean_ms": _ms(self.latency),
        }


def _ms(xs: list[float]) -> float:
    return round(sum(xs) / len(xs) * 1e3, 2) if xs else float("nan")


def engine_side(snapshot) -> dict:
    """The engine's own view of the requests (its clock: submit in the engine -> first token,
    -> last response), from a snapshot taken after a run (it holds what the run observed)."""
    return {"engine_ttft_mean_ms": _ms(snapshot.ttft),
            "engine_latency_mean_ms": _ms(snapshot.latency)}


def scrape(port: int) -> dict[str, float]:
    """The llm model's series (ours and Triton's per-model ones) on tritonserver's metrics
    endpoint, summed over labels (buckets left out)."""
    from triton_helpers import metrics

    return metrics(f"http://127.0.0.1:{port}/metrics", "llm", ("llm_", "nv_inference_"))


def served_side(before: dict[str, float], after: dict[str, float]) -> dict:
    """Means per request over a run, from the metrics' deltas: Triton's queue (waiting for the
    stub's execute(), which runs one call at a time), execute() itself, and the engine's own TTFT
    and latency (as engine_side)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    n = d.get("nv_inference_request_success", 0.0) or float("nan")

    def mean(name: str) -> float:
        count = d.get(f"{name}_count", 0.0) or float("nan")
        return round(d.get(f"{name}_sum", float("nan")) / count * 1e3, 2)

    return {
        "triton_queue_mean_ms": round(d.get("nv_inference_queue_duration_us", 0.0) / n / 1e3, 3),
        "triton_execute_mean_ms": round(
            d.get("nv_inference_compute_infer_duration_us", 0.0) / n / 1e3, 3),
        "engine_ttft_mean_ms": mean("llm_time_to_first_token_seconds"),
        "engine_latency_mean_ms": mean("llm_request_latency_seconds"),
    }


def run_pool(concurrency: int, n: int, one, first: int = 0) -> tuple[Timing, float]:
    """Requests first..first + n - 1 through `concurrency` threads; (timing, wall seconds)."""
    timing, jobs = Timing(), queue.Queue()
    for i in range(first, first + n):
        jobs.put(i)

    def worker():
        while True:
            try:
                i = jobs.get_nowait()
            except queue.Empty:
                break
            one(i, timing)
        if hasattr(one, "close"):
            one.close()  # NOTE: on this worker thread: what it kept open (its gRPC stream)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return timing, time.perf_counter() - t0


def direct_one(engine: Engine, new: int, ids: bool = False):
    def one(i: int, timing: Timing):
        start = time.perf_counter()
        text = dict(prompt_ids=prompt_ids(i)) if ids else dict(prompt=prompt(i))
        stream = engine.submit(GenerationRequest(
            f"d{i}-{time.monotonic_ns()}", **text,
            sampling=SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)))
        arrivals = [(time.perf_counter(), len(d.token_ids)) for d in stream if d.token_ids]
        timing.record(start, arrivals)
    return one


def run_direct_sinks(engine: Engine, concurrency: int, n: int, new: int, ids: bool) -> tuple[Timing, float]:
    """Engine-direct without a consumer thread per request: sinks record arrivals, and a finished
    request's slot is refilled by one submitter thread (a closed loop of `concurrency`)."""
    timing, lock, todo = Timing(), threading.Lock(), queue.Queue()
    started: dict[str, tuple[float, list]] = {}
    finished = threading.Semaphore(0)

    def sink(d):
        now = time.perf_counter()
        start, arrivals = started[d.request_id]
        if d.token_ids:
            arrivals.append((now, len(d.token_ids)))
        if d.request_done:
            timing.record(start, arrivals)
            todo.put(1)
            finished.release()

    def submitter():
        for i in range(n):
            if i >= concurrency:
                todo.get()
            rid = f"s{i}-{time.monotonic_ns()}"
            text = dict(prompt_ids=prompt_ids(i)) if ids else dict(prompt=prompt(i))
            with lock:
                started[rid] = (time.perf_counter(), [])
            engine.submit(GenerationRequest(rid, **text, sampling=SamplingParams(
                max_tokens=new, temperature=0.0, ignore_eos=True)), sink=sink)

    t0 = time.perf_counter()
    threading.Thread(target=submitter, daemon=True).start()
    for _ in range(n):
        finished.acquire()
    return timing, time.perf_counter() - t0


def grpc_one(url: str, new: int, use_ids: bool = False, reuse: bool = True,
             outputs: tuple[str, ...] = ()):
    """One request on a gRPC stream: with `reuse`, each client thread keeps one stream for all
    its requests (as a load generator or a long-lived client does); else a stream (channel,
    connection) is opened and closed per request, and its set-up counts as serving time.
    outputs: the outputs each request names (none: all)."""
    from triton_helpers import GrpcStream

    local = threading.local()

    def one(i: int, timing: Timing):
        s = getattr(local, "stream", None)
        if s is None:
            s = GrpcStream(url)
            if reuse:
                local.stream = s
        start = time.perf_counter()
        text = dict(input_ids=prompt_ids(i)) if use_ids else dict(text_input=prompt(i))
        s.send(dict(**text, max_tokens=new, temperature=0.0, ignore_eos=True, stream=True),
               request_id=f"g{i}", outputs=outputs)
        arrivals = []
        while True:
            result, error = s.queue.get(timeout=600)
            assert error is None, error
            now = time.perf_counter()
            ids = result.as_numpy("output_ids")
            if ids is not None and len(ids):
                arrivals.append((now, len(ids)))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        if not reuse:
            s.close()
        timing.record(start, arrivals)

    def close():
        s = getattr(local, "stream", None)
        if s is not None:
            s.close()
            local.stream = None

    one.close = close
    return one


def _client_proc(job) -> tuple[list[float], list[float], list[float], int, float, float]:
    url, new, first, n, concurrency, ids, reuse, outputs, cpus, start_at = job
    if cpus:
        os.sched_setaffinity(0, cpus)
    # NOTE: every process starts at the same wall-clock moment (spawned processes are ready at
    # different times, seconds apart: their skew would count as serving time)
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    timing, _ = run_pool(concurrency, n, grpc_one(url, new, ids, reuse, outputs), first)
    return timing.ttft, timing.itl, timing.latency, timing.tokens, t0, time.time()


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def run_procs(url: str, new: int, concurrency: int, n: int, procs: int, ids: bool, reuse: bool,
              outputs: tuple[str, ...], cpus: set[int]) -> tuple[Timing, float]:
    """gRPC streams from `procs` client processes, concurrency / procs streams each (on `cpus`
    when given)."""
    assert concurrency % procs == 0 and n % procs == 0, "concurrency and requests: multiples of procs"
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        up: set[int] = set()
        while len(up) < procs:  # NOTE: every worker up (its imports done) before the start time
            up |= set(pool.map(_pid_after, [0.05] * 2 * procs, chunksize=1))
        start_at = time.time() + 1.0
        jobs = [(url, new, p * (n // procs), n // procs, concurrency // procs, ids, reuse,
                 outputs, cpus, start_at) for p in range(procs)]
        parts = pool.map(_client_proc, jobs, chunksize=1)
    timing = Timing()
    for ttft, itl, latency, tokens, _, _ in parts:
        timing.ttft += ttft
        timing.itl += itl
        timing.latency += latency
        timing.tokens += tokens
    return timing, max(p[5] for p in parts) - min(p[4] for p in parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--shape", default="", help="GPU: a bench/shapes.py shape, random weights")
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--streams", nargs="+", choices=("reuse", "fresh"), default=["reuse"],
                    help="gRPC client streams: kept by each client thread for all its requests, or "
                         "one per request; the first listed gives the ratio, each its own row")
    ap.add_argument("--client-cpus", type=int, default=0,
                    help="client processes on the last N CPUs, everything else (the engine rows, "
                         "tritonserver) on the others, as if the clients ran on another machine")
    ap.add_argument("--child-path", default="",
                    help="a folder put first on the engine process's import path (as the stub's, e.g. "
                         "numpy<2 for tritonserver 2.51), for a second engine-process row")
    ap.add_argument("--no-server", action="store_true", help="engine rows only")
    ap.add_argument("--sinks-only", action="store_true",
                    help="engine direct through sinks only (no thread-per-request row)")
    ap.add_argument("--outputs", nargs="*", default=[], metavar="NAME",
                    help="the outputs each gRPC request names (default none: all of them)")
    ap.add_argument("--gpus", type=int, nargs="*", default=[], help="GPU: the server's llm as one "
                    "instance (engine) on each of these GPUs; the direct engine stays one")
    ap.add_argument("--param", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine parameters (config.pbtxt keys) for the engine and the served model")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_triton.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # NOTE: the engines' step counts

    rows = {c: {} for c in args.concurrency}
    client_cpus: set[int] = set()
    if args.client_cpus:
        cpus = sorted(os.sched_getaffinity(0))
        assert 0 < args.client_cpus < len(cpus), f"--client-cpus: 1..{len(cpus) - 1}"
        client_cpus = set(cpus[-args.client_cpus:])
        os.sched_setaffinity(0, set(cpus[: -args.client_cpus]))  # NOTE: inherited by the server
    params = dict(p.split("=", 1) for p in args.param)
    outputs = tuple(args.outputs)
    ids = bool(args.shape)
    if ids:
        from shapes import random_model

        folder = random_model(args.shape)
        base = dict(model=folder, device="cuda", load_format="dummy", dtype="bfloat16", max_num_seqs="64")
        repo = gpu_repository(folder, tempfile.mkdtemp(), params, args.gpus)
    else:
        base = dict(device="cpu", max_num_seqs="64")
        repo = REPO if not params else gpu_repository("default", tempfile.mkdtemp(), params)
    config = EngineConfig.from_parameters({**base, **params})
    engine = Engine(config).start()
    try:
        run_pool(2, 2, direct_one(engine, 8, ids))  # warm-up
        for c in args.concurrency:
            n = max(args.requests if c > 1 else 4, c)
            engine.snapshot()  # NOTE: drops the observations so far
            if not args.sinks_only:
                timing, wall = run_pool(c, n, direct_one(engine, args.new, ids))
                rows[c]["direct"] = timing.summary(wall) | engine_side(engine.snapshot())
                print(f"direct c={c}: {rows[c]['direct']}", flush=True)
            timing, wall = run_direct_sinks(engine, c, n, args.new, ids)
            rows[c]["direct_sinks"] = timing.summary(wall) | engine_side(engine.snapshot())
            print(f"direct (sinks) c={c}: {rows[c]['direct_sinks']}", flush=True)
    finally:
        engine.shutdown()
    for row, path in (("child_sinks", ""), ("child_sinks_path", args.child_path)):
        if row != "child_sinks" and not path:
            continue
        if path:
            sys.path.insert(0, path)  # NOTE: the child process starts with this sys.path
        child = EngineProcess(config).start()  # NOTE: what the adapter runs, without Triton
        try:
            run_direct_sinks(child, 2, 2, 8, ids)  # warm-up
            for c in args.concurrency:
                n = max(args.requests if c > 1 else 4, c)
                child.snapshot()
                timing, wall = run_direct_sinks(child, c, n, args.new, ids)
                rows[c][row] = timing.summary(wall) | engine_side(child.snapshot())
                print(f"engine process ({row}) c={c}: {rows[c][row]}", flush=True)
        finally:
            child.shutdown()
            if path:
                sys.path.remove(path)
    if args.no_server:
        print(rows)
        return
    server = start_server(repo, log_path=os.path.join(os.path.dirname(args.out), "triton_bench_server.log"))
    try:
        server.wait_ready(timeout=600, models=("llm",))
        run_pool(2, 2, grpc_one(server.grpc_url, 8, ids))  # warm-up
        for c in args.concurrency:
            n = max(args.requests if c > 1 else 4, c)
            best = max(rows[c][p]["tok_s"] for p in ("direct", "direct_sinks") if p in rows[c])
            for k, mode in enumerate(args.streams):
                reuse = mode == "reuse"
                time.sleep(0.5)  # NOTE: the adapter refreshes its metrics every 0.1 s
                before = scrape(server.ports.metrics)
                if args.client_procs > 1 and c >= args.client_procs:
                    timing, wall = run_procs(server.grpc_url, args.new, c, n, args.client_procs,
                                             ids, reuse, outputs, client_cpus)
                else:
                    timing, wall = run_pool(c, n, grpc_one(server.grpc_url, args.new, ids, reuse,
                                                           outputs))
                row, ratio = f"grpc_{mode}", f"ratio_{mode}"
                if k == 0:  # NOTE: the first listed: the keys the results have always used
                    row, ratio = "grpc_stream", "ratio"
                time.sleep(0.5)
                served = served_side(before, scrape(server.ports.metrics))
                rows[c][row] = timing.summary(wall) | served | {"streams": mode}
                rows[c][ratio] = round(rows[c][row]["tok_s"] / best, 3)  # NOTE: vs the faster
                print(f"grpc ({mode} streams) c={c}: {rows[c][row]} ratio {rows[c][ratio]}",
                      flush=True)
    finally:
        server.stop()
    with open(server.log_path, errors="replace") as f:  # NOTE: the served engine's step counts
        served_log = [line.strip() for line in f if "engine loop ended" in line]
    print("\n".join(served_log))
    write_result(args.out, {
        "benchmark": "grpc_streaming_vs_engine_direct",
        "model": f"{args.shape} random bf16 (GPU)" if ids else "SmolLM2-135M-Instruct float32 (CPU)",
        **({"stream_vs_direct_ratio_c64": rows[64]["ratio"]} if 64 in rows else {}),
        "new_tokens": args.new,
        "params": params,
        "streams": args.streams,
        "outputs": list(outputs) or "all",
        "client_cpus": sorted(client_cpus),
        "cpus": os.cpu_count(),
        "rows": [{"concurrency": c, **r} for c, r in rows.items()],
        "served_engine_log": served_log,
    })
    print("| concurrency | path | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---:|---|---:|---:|---:|")
    for c, r in rows.items():
        for path in [p for p in r if isinstance(r[p], dict)]:
            x = r[path]
            print(f"| {c} | {path} | {x['tok_s']} | {x['ttft_p50_ms']} / {x['ttft_p99_ms']} | "
                  f"{x['itl_p50_ms']} / {x['itl_p99_ms']} |")
        print(f"| {c} | ratio grpc/direct | {r['ratio']} | | |")


if __name__ == "__main__":
    main()
