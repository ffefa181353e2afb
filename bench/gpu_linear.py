"""The fused MLP kernel (kernels/fused_linear.py: residual add + RMSNorm + [gate; up] product +
SiLU-mul) against the three kernels it replaces (norm kernel, cuBLAS, SiLU-mul kernel), bf16.

Each is timed as one CUDA graph over enough distinct weight copies (about 400 MB) that the L2
cache holds none of them, as in a decode step where each layer's weights are read once.
--sweep also tries the tile configurations and reports the best.

    python bench/gpu_linear.py [--shapes llama-1b llama-8b] [--rows 1 2 4] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
from shapes import SHAPES  # noqa: E402

from hsserve.kernels.elementwise import add_rmsnorm_triton, silu_mul_triton  # noqa: E402
from hsserve.kernels.fused_linear import norm_gate_up_silu  # noqa: E402

SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
         for n, k, w, s in itertools.product((4, 8, 16), (256, 512, 1024), (1, 2, 4), (2, 3))]


def timed(fns) -> float:
    """Median GPU ms per call over a round of distinct weights, replayed as one CUDA graph."""
    fns[0]()  # NOTE: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / len(fns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    for shape in args.shapes:
        h, i = SHAPES[shape]["hidden_size"], SHAPES[shape]["intermediate_size"]
        copies = max(2, int(400e6 // (2 * i * h * 2)))
        ws = [torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        g = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        for m in args.rows:
            x, r = (torch.randn(m, h, device="cuda", dtype=torch.bfloat16) for _ in range(2))

            def three(w):
                return lambda: silu_mul_triton(F.linear(add_rmsnorm_triton(x, r, g, 1e-5)[0], w))

            def fused(w, config=None):
                return lambda: norm_gate_up_silu(x, r, g, 1e-5, w, config=config)

            row = {"shape": shape, "rows": m, "hidden": h, "intermediate": i,
                   "three_kernels_ms": timed([three(w) for w in ws]),
                   "fused_ms": timed([fused(w) for w in ws])}
            if args.sweep:
                best = (row["fused_ms"], None)
                for c in SWEEP:
                    try:
                        best = min(best, (timed([fused(w, c) for w in ws]), c), key=lambda b: b[0])
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        print(f"  skip {c}: {type(e).__name__}", flush=True)
                row["best_ms"], row["best_config"] = best
            for key in ("three_kernels_ms", "fused_ms", "best_ms"):
                if key in row:
                    row[key.replace("_ms", "_tb_s")] = round(2 * i * h * 2 / row[key] / 1e9, 2)
                    row[key] = round(row[key], 4)
            print(json.dumps(row), flush=True)
            results.append(row)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
