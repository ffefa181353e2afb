"""The float8 GEMM at decode rows inside a CUDA graph (no launch overhead, weights rotated past
L2), as the engine's decode step runs it: bf16 cuBLAS vs float8 weights only (x bf16, W widened)
vs float8 weights and activations (x quantized per token first, FP8 tensor cores), and the w8a8
kernel's launch configs swept.

    python3 bench/fp8_graph.py [--rows 16 64] [--out FILE]

Writes us per GEMM and its bandwidth against the weight's bytes (default
bench/results/fp8_graph.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import time_graph, write_result  # noqa: E402
from fp8_gemm import SHAPES  # noqa: E402

import hsserve.kernels.fp8 as fp8  # noqa: E402
from hsserve.models.fp8 import quantize  # noqa: E402

W8A8 = [(16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (32, 64, 256, 4, 4), (64, 64, 128, 4, 4),
        (64, 128, 128, 4, 4), (64, 64, 256, 4, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3),
        (32, 128, 256, 4, 3)]
L2_BYTES = 256 << 20  # NOTE: rotate copies until they exceed every Hopper L2 several times


def _copies(n: int, k: int, dtype_bytes: int) -> int:
    return max(2, min(16, L2_BYTES // (n * k * dtype_bytes) + 1))


def _time(fn, copies: int) -> float:
    return time_graph(lambda i: fn(i % copies), calls=2 * copies, replays=10)


def one_shape(n: int, k: int, rows: list[int]) -> list[dict]:
    c16, c8 = _copies(n, k, 2), _copies(n, k, 1)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(c16)]
    q = [quantize(w16[i % c16]) for i in range(c8)]
    wo = [fp8.Fp8Scales(s) for _, s in q]
    wa = [fp8.Fp8Scales(s, quantize_inputs=True) for _, s in q]
    out, default = [], fp8.gemm_config
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bf16 = _time(lambda i: x @ w16[i].T, c16)
        only = _time(lambda i: fp8.fp8_gemm(x, q[i][0], wo[i]), c8)
        w8a8 = _time(lambda i: fp8.fp8_gemm(x, q[i][0], wa[i]), c8)
        sweep = {}
        for cfg in W8A8:
            fp8.gemm_config = lambda *_a, cfg=cfg: cfg
            try:
                sweep[",".join(map(str, cfg))] = round(
                    _time(lambda i: fp8.fp8_gemm(x, q[i][0], wa[i]), c8), 2)
            except Exception as e:  # noqa: BLE001 - a config past shared memory: skipped
                print(f"{m}x{n}x{k} {cfg}: {type(e).__name__}", flush=True)
        fp8.gemm_config = default
        best = min(sweep, key=sweep.get) if sweep else None
        row = {"m": m, "n": n, "k": k, "bf16_us": round(bf16, 2), "fp8_w_us": round(only, 2),
               "fp8_w8a8_us": round(w8a8, 2), "w8a8_best": best,
               "w8a8_best_us": sweep.get(best), "fp8_tb_s_w": round(n * k / only / 1e6, 3),
               "fp8_tb_s_w8a8": round(n * k / w8a8 / 1e6, 3),
               "bf16_tb_s": round(2 * n * k / bf16 / 1e6, 3), "w8a8_sweep": sweep}
        print({a: b for a, b in row.items() if a != "w8a8_sweep"}, flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "fp8_graph.json"))
    args = ap.parse_args()
    rows = []
    for n, k in SHAPES:
        rows += one_shape(n, k, args.rows)
        torch.cuda.empty_cache()
    write_result(args.out, {"benchmark": "fp8_graph", "rows": rows})


if __name__ == "__main__":
    main()
