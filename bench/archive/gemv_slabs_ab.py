"""A/B of the one-row GEMV's slab (rows a program, warps) per product, in a real batch-1 decode
graph: one engine, its graph recaptured with gemv_config overridden for chosen (N, K), replays
timed by CUDA events (best of 2 x 100, variants interleaved `--rounds` times). Random weights.

    python bench/archive/gemv_slabs_ab.py [--shape qwen3-30b-a3b] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import event_ms, write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

import hsserve.kernels.gemv as G  # noqa: E402

DEFAULT = G.gemv_config
QKV, O = (5120, 2048), (2048, 4096)  # NOTE: Qwen3-30B-A3B's (N, K)
VARIANTS = {"default": {}, "qkv4": {QKV: (4, 4)}, "qkv2": {QKV: (2, 4)}, "qkv2w2": {QKV: (2, 2)},
            "o8": {O: (8, 4)}, "o2": {O: (2, 4)}, "qkv2_o8": {QKV: (2, 4), O: (8, 4)}}


def replay_us(engine, overrides: dict) -> float:
    G.gemv_config = lambda n, k, size: overrides.get((n, k)) or DEFAULT(n, k, size)
    try:
        graphs = engine.executor.graphs
        graphs.capture()
        return 1000 * min(event_ms(graphs.graphs[(1, False)].replay, 100) for _ in range(2))
    finally:
        G.gemv_config = DEFAULT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    engine = make_engine(random_model(args.shape), 1)
    rows: dict[str, float] = {}
    try:
        engine_run(engine, 1, tag="warm")
        for _ in range(args.rounds):
            for name, overrides in VARIANTS.items():
                us = replay_us(engine, overrides)
                rows[name] = round(min(rows.get(name, us), us), 1)
                print(json.dumps({"variant": name, "us": round(us, 1)}), flush=True)
    finally:
        engine.shutdown()
    write_result(args.out or os.path.join(os.path.dirname(__file__), "results",
                                          f"h200_gemv_slabs_{args.shape}.json"),
                 {"benchmark": "gemv_slabs_ab", "shape": args.shape, "batch": 1,
                  "replay_us": rows})


if __name__ == "__main__":
    main()
