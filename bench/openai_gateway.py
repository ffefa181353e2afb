"""What the OpenAI gateway costs: streamed tok/s through `hsserve openai` vs gRPC straight to `llm`.

One tritonserver (the repository's `llm`, SmolLM2-135M float32 on the CPU) and the gateway beside
it (`hsserve openai`), same machine, same prompts (64 token ids), 64 new tokens, greedy, EOS
ignored; at concurrency c, 2c requests keep c in flight. gRPC: tritonclient streams (one per
client thread, reused); HTTP: Triton's generate_stream and OpenAI: streaming /v1/completions,
both with the same client (server-sent events, http.client threads). Measured in turns each
round, --repeats rounds, medians; tok/s = output tokens / wall time.

    python bench/openai_gateway.py [--concurrency 32] [--repeats 3]
    python3 bench/openai_gateway.py --shape llama-1b --tokenizer .whl/tok --concurrency 64 \
        --out $OUT/h200_openai_gateway.json   # GPU, random bf16 weights (gpu_session.sh openai)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integration"))
from common import write_result  # noqa: E402
from cpu_served_vs_vllm import NEW, measure, ours, vllm  # noqa: E402
from engine_vs_hf_cpu import prompts  # noqa: E402

from hsserve.models.default_model import default_cache_dir, ensure_default_model  # noqa: E402
from hsserve.triton.server import free_ports, start_server  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..", "model_repository")


def grpc_side(url: str):
    """One streamed request over gRPC: (seconds to the first token, to the end, tokens)."""
    from triton_helpers import GrpcStream

    local = threading.local()

    def one(ids):
        s = getattr(local, "stream", None) or GrpcStream(url)
        local.stream = s
        t0, first, tokens = time.perf_counter(), None, 0
        s.send(dict(input_ids=ids, max_tokens=NEW, temperature=0.0, ignore_eos=True,
                    stream=True))
        while True:
            result, error = s.queue.get(timeout=600)
            assert error is None, error
            out = result.as_numpy("output_ids")
            if out is not None and len(out):
                first = first or time.perf_counter() - t0
                tokens += len(out)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return first, time.perf_counter() - t0, tokens
    return one


def start_gateway(grpc_url: str, port: int, repo: str, log: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "hsserve.cli", "openai", "--host", "127.0.0.1",
                             "--port", str(port), "--grpc-url", grpc_url, "--model-repository",
                             repo, "--served-model-name", "smol"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the gateway did not start; see {log}") from None
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="", help="GPU: a bench/shapes.py shape, random weights")
    ap.add_argument("--tokenizer", default="", help="GPU: a folder with SmolLM2's tokenizer files")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "openai_gateway_cpu.json"))
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    repo = REPO
    if args.shape:
        from guided_cost import model_folder
        from triton_stream_vs_direct import gpu_repository

        repo = gpu_repository(model_folder(args.shape, args.tokenizer), os.path.join(root, "r"),
                              {"max_num_seqs": "64"})
    else:
        ensure_default_model(os.environ.get("HSSERVE_CACHE_DIR") or default_cache_dir())
    server = start_server(repo, log_path=os.path.join(root, "triton.log"))
    gateway = None
    rounds: dict[int, list[dict]] = {c: [] for c in args.concurrency}
    try:
        server.wait_ready(timeout=600, models=("llm",))
        port = free_ports(1)[0]
        gateway = start_gateway(server.grpc_url, port, repo, os.path.join(root, "gateway.log"))
        sides = {"grpc": grpc_side(server.grpc_url), "http": ours(server.ports.http),
                 "openai": vllm(port, "smol")}
        for side in sides.values():  # NOTE: warm-up
            measure(side, prompts(2, 64, 49152, 99), 2)
        for r in range(args.repeats):
            for c in args.concurrency:
                batch = prompts(2 * c, 64, 49152, 100 + r)
                got = {name: measure(side, batch, c) for name, side in sides.items()}
                rounds[c].append(got)
                print(f"c={c} round {r}: " + ", ".join(
                    f"{k} {v['tok_s']:.1f} tok/s (TTFT {v['ttft_p50_ms']:.0f} ms)"
                    for k, v in got.items()), flush=True)
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(30)
        server.stop()
    rows = []
    for c, rs in rounds.items():
        med = {f"{s}_{k}": round(statistics.median(r[s][k] for r in rs), 1)
               for s in ("grpc", "http", "openai") for k in ("tok_s", "ttft_p50_ms")}
        rows.append({"concurrency": c, **med,
                     "openai_over_grpc": round(med["openai_tok_s"] / med["grpc_tok_s"], 3),
                     "openai_over_http": round(med["openai_tok_s"] / med["http_tok_s"], 3)})
    model = f"{args.shape} random bf16 (GPU)" if args.shape else "SmolLM2-135M float32 (CPU)"
    write_result(args.out, {"benchmark": "openai_gateway", "model": model,
                            "prompt_len": 64, "new_tokens": NEW, "repeats": args.repeats,
                            "rows": rows})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
