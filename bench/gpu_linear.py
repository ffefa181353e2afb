"""Tile sweep of the fused small-batch linear kernels (kernels/fused_linear.py) against cuBLAS.

Every weight matrix of a shape at M rows, bf16, timed over enough distinct weight copies (about
400 MB) that the L2 cache holds none of them, as in a real decode step where each layer's weights
are read once. Prints GB/s per matrix: cuBLAS F.linear, and our kernel with its default config
and the best config of the sweep (with the norm prologue and the epilogue the model uses).

    python bench/gpu_linear.py [--shapes llama-1b llama-8b] [--rows 1 16] [--sweep]
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

from hsserve.kernels import fused_linear as fl  # noqa: E402

SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
         for n, k, w, s in itertools.product((8, 16, 32), (128, 256, 512), (2, 4, 8), (2, 4))]


def matrices(cfg: dict) -> dict:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"qkv": (q + 2 * kv, h, "rope"), "o_proj": (h, q, "plain"), "gate_up": (2 * i, h, "silu"),
            "down": (h, i, "plain"), "lm_head": (v, h, "plain")}


def timed(fns) -> float:
    """Median GPU ms per call over a round of distinct weights, replayed as one CUDA graph (as in
    the decode step: no launch overhead from Python)."""
    for f in fns[:1]:
        f()  # NOTE: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median") / len(fns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    for shape in args.shapes:
        cfg = SHAPES[shape]
        heads, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        for name, (n, k, kind) in matrices(cfg).items():
            copies = max(2, int(400e6 // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            nbytes = n * k * 2
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r, g = torch.randn_like(x), torch.ones(k, device="cuda", dtype=torch.bfloat16)
                cos = torch.ones(m, d // 2, device="cuda")
                kv = torch.zeros(2, 8, 16, kvh, d, device="cuda", dtype=torch.bfloat16)
                slots = torch.arange(m, device="cuda")

                def ours(w, config):
                    if kind == "rope":
                        return lambda: fl.norm_qkv_rope_store(x, r, g, 1e-5, w, None, cos, cos, kv,
                                                              slots, heads, kvh, d, config=config)
                    if kind == "silu":
                        return lambda: fl.norm_gate_up_silu(x, r, g, 1e-5, w, config=config)
                    return lambda: fl.linear(x, w, config=config)

                row = {"shape": shape, "matrix": name, "rows": m, "n": n, "k": k,
                       "cublas_ms": timed([lambda w=w: F.linear(x, w) for w in ws])}
                row["ours_ms"] = timed([ours(w, None) for w in ws])
                if args.sweep and m == args.rows[0]:
                    best = (row["ours_ms"], None)
                    for c in SWEEP:
                        if (kind == "rope" and c["BLOCK_N"] > d // 2) or name == "lm_head":
                            continue
                        try:
                            t = timed([ours(w, c) for w in ws])
                        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                            print(f"  skip {c}: {type(e).__name__}", flush=True)
                            continue
                        best = min(best, (t, c), key=lambda b: b[0])
                    row["best_ms"], row["best_config"] = best
                for key in ("cublas_ms", "ours_ms", "best_ms"):
                    if key in row:
                        row[key.replace("_ms", "_gb_s")] = round(nbytes / row[key] / 1e6, 1)
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
