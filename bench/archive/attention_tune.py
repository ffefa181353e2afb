"""Paged decode attention's launch configuration swept at one batch shape: keys per loop step,
warps and pipeline stages, each timed as a CUDA graph of calls over distinct layers' caches
(16 layers, as the 1B shape has: the keys come from memory, not L2), us per call and the KV
bytes read per second. The split count is the engine's heuristic's.

    python bench/attention_tune.py [--batch 64] [--ctx 192] [--out ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from attention_splits import make_inputs, shape_args  # noqa: E402
from common import time_graph, write_result  # noqa: E402

from hsserve.kernels.paged_decode_attention import paged_decode_attention  # noqa: E402

LAYERS = 16


def main() -> None:
    ap = shape_args(argparse.ArgumentParser())
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    q, kv, tables, lens = make_inputs(args.batch, args.ctx, args.heads, args.kv_heads,
                                      args.head_dim, 16, torch.bfloat16, "cuda")
    caches = [kv] + [torch.randn_like(kv) for _ in range(LAYERS - 1)]
    kv_bytes = 2 * args.batch * args.ctx * args.kv_heads * args.head_dim * 2
    counters = torch.zeros(args.batch * args.kv_heads, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    rows = []
    for tokens, warps, stages in itertools.product(args.tokens, args.warps, args.stages):
        cfg = (tokens, warps, stages)
        try:
            us = time_graph(lambda i, c=cfg: paged_decode_attention(
                q, caches[i % LAYERS], tables, lens, 0.125, out=out, counters=counters,
                config=c), 4 * LAYERS)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (resources)
            print(json.dumps({"config": cfg, "error": repr(e)[:120]}), flush=True)
            continue
        row = {"tokens": tokens, "warps": warps, "stages": stages, "us": round(us, 2),
               "kv_tb_s": round(kv_bytes / us / 1e6, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    rows.sort(key=lambda r: r["us"])
    print("best", rows[:3])
    if args.out:
        write_result(args.out, {"benchmark": "attention_tune", **vars(args), "rows": rows})


if __name__ == "__main__":
    main()
