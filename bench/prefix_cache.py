"""Shared-prefix workload: prefix-cache hit rate and time to first token, cache on vs off.

64 requests share a 1,000-token system prompt and differ in a short question (random token ids);
all are submitted at once (a burst), each asks for a few tokens. TTFT = submit -> the first
delta carrying a token. Each setting runs in its own engine, cold, after one unrelated warm-up.

    python bench/prefix_cache.py [--device cpu|cuda] [--model default|<folder>] [--random llama-1b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402


def workload(num: int, system_len: int, question_len: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, vocab - 100, (system_len,), generator=g).tolist()
    return [system + torch.randint(100, vocab - 100, (question_len,), generator=g).tolist()
            for _ in range(num)]


def run(config: EngineConfig, prompts: list[list[int]], new: int) -> dict:
    engine = Engine(config).start()
    try:
        sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        engine.generate(GenerationRequest("warm", prompt_ids=[7, 8, 9] * 20, sampling=sp))
        q0, h0 = engine.pool.num_query_tokens, engine.pool.num_hit_tokens
        first: dict[str, float] = {}
        done = threading.Semaphore(0)
        lock = threading.Lock()

        def sink_for(rid: str, t0: float):
            def sink(delta):
                with lock:
                    if delta.token_ids and rid not in first:
                        first[rid] = time.perf_counter() - t0
                if delta.request_done:
                    done.release()
            return sink

        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            rid = f"q{i}"
            engine.submit(GenerationRequest(rid, prompt_ids=p, sampling=sp), sink=sink_for(rid, t0))
        for _ in prompts:
            done.acquire()
        wall = time.perf_counter() - t0
        ttft = sorted(first.values())
        queried = engine.pool.num_query_tokens - q0
        return {
            "enable_prefix_caching": config.enable_prefix_caching,
            "hit_rate": round((engine.pool.num_hit_tokens - h0) / queried, 4),
            "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
            "ttft_p90_ms": round(1000 * ttft[int(0.9 * (len(ttft) - 1))], 1),
            "wall_s": round(wall, 2),
        }
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--random", choices=sorted(SHAPES), help="random weights in this shape instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    model = random_model(args.random) if args.random else args.model
    rows = []
    spec = None
    for caching in (False, True):
        config = EngineConfig(model=model, device=args.device, dtype=args.dtype,
                              load_format="dummy" if args.random else "auto",
                              max_num_seqs=args.requests, enable_prefix_caching=caching)
        if spec is None:
            probe = Engine(config).start()
            spec = probe.spec
            probe.shutdown()
            prompts = workload(args.requests, args.system_len, args.question_len, spec.vocab_size)
        rows.append(run(config, prompts, args.new))
        print(rows[-1], flush=True)
    off, on = rows
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"prefix_cache_{'cpu' if args.device == 'cpu' else 'gpu'}.json")
    write_result(out, {
        "benchmark": "shared_prefix_ttft",
        "model": args.random or ("SmolLM2-135M-Instruct" if model == "default" else model),
        "model_shape": {"layers": spec.num_layers, "hidden": spec.hidden_size,
                        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads},
        "device": args.device,
        "dtype": args.dtype,
        "requests": args.requests,
        "system_len": args.system_len,
        "question_len": args.question_len,
        "new_tokens": args.new,
        "rows": rows,
        "ttft_p50_speedup": round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 2),
    })
    print(f"TTFT p50: {off['ttft_p50_ms']} ms off, {on['ttft_p50_ms']} ms on "
          f"({off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x); hit rate {on['hit_rate']:.1%}")


if __name__ == "__main__":
    main()
