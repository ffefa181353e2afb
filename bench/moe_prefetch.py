"""A/B of the L2 prefetches at one token (kernels/l2_prefetch.py) in a real batch-1 decode graph:
one engine, its graph recaptured with each on or off, replays timed by CUDA events (best of
`--rounds` x 100, variants interleaved round by round). Random weights, Qwen3-30B-A3B shape.

    python bench/moe_prefetch.py [--rounds 3] [--out FILE]

Variants (VARIANTS): none; down (gate_up asks L2 for its expert's down weights); next (the router
asks for the next layer's qkv weights while the routing runs); both; each plain or evict_last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

import hsserve.kernels.moe as kmoe  # noqa: E402
import hsserve.kernels.moe_route as route  # noqa: E402

# NOTE: (gate_up's ask for down, the router's for the next qkv): l2_prefetch's MODE, 0 off
VARIANTS = {"none": (0, 0), "down_last": (2, 0), "next_last": (0, 2), "both_last": (2, 2),
            "down_lines": (3, 0), "next_lines": (0, 3), "both_lines": (3, 3)}


def replay_us(engine, variant: str) -> float:
    shipped = kmoe.PREFETCH_DOWN, route.PREFETCH_NEXT
    kmoe.PREFETCH_DOWN, route.PREFETCH_NEXT = VARIANTS[variant]
    try:
        graphs = engine.executor.graphs
        graphs.capture()
        graph = graphs.graphs[(1, False)]
        return 1000 * min(event_ms(graph.replay, 100) for _ in range(2))
    finally:
        kmoe.PREFETCH_DOWN, route.PREFETCH_NEXT = shipped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    engine = make_engine(random_model(args.shape), 1)
    rows: dict[str, float] = {}
    try:
        engine_run(engine, 1, tag="warm")
        for _ in range(args.rounds):
            for variant in VARIANTS:
                us = replay_us(engine, variant)
                rows[variant] = round(min(rows.get(variant, us), us), 1)
                print(json.dumps({"variant": variant, "us": round(us, 1)}), flush=True)
    finally:
        engine.shutdown()
    write_result(args.out or os.path.join(os.path.dirname(__file__), "results",
                                          "h200_moe_prefetch.json"),
                 {"benchmark": "moe_prefetch", "shape": args.shape, "batch": 1, "replay_us": rows})


if __name__ == "__main__":
    main()
