"""bf16 linears at a verify step's few rows (2-16) inside a CUDA graph, weights rotated past L2:
cuBLAS vs our GEMV (kernels/gemv.py, its row limit lifted) vs the swapped tensor-core GEMM
(kernels/fp8.py's Y^T = W X^T kernel with bf16 weights and unit scales), configs swept.

    python3 bench/bf16_rows.py [--rows 1 5 16] [--out FILE]

Writes us per GEMM and its bandwidth against the weight's bytes (default
bench/results/bf16_rows.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from fp8_graph import _copies, _time  # noqa: E402

import hsserve.kernels.fp8 as fp8  # noqa: E402
import hsserve.kernels.gemv as gemv  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # NOTE: an 8B layer's
SWAP = [(bw, 16, bk, s, w, st) for bw, w in ((32, 4), (64, 4), (128, 4), (128, 8))
        for bk in (128, 256) for s in (1, 2) for st in (3, 4)]


def one_shape(n: int, k: int, rows: list[int]) -> list[dict]:
    c = _copies(n, k, 2)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(c)]
    unit = fp8.Fp8Scales(torch.ones(n, device="cuda", dtype=torch.float32))
    out = []
    gemv.MAX_ROWS = 16
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x @ ws[0].T
        row = dict(n=n, k=k, rows=m, cublas_us=round(_time(lambda i: x @ ws[i].T, c), 2))
        row["gemv_us"] = round(_time(lambda i: gemv.gemv(x, ws[i], pdl=False), c), 2)
        sweep = {}
        for cfg in SWAP:
            try:
                y = fp8._swap_gemm(x, ws[0], unit, None, None, cfg)
                assert torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
                us = _time(lambda i, cfg=cfg: fp8._swap_gemm(x, ws[i], unit, None, None, cfg), c)
                sweep[",".join(map(str, cfg))] = round(us, 2)
            except Exception as e:  # noqa: BLE001 - a config past shared memory: skipped
                print(f"{m}x{n}x{k} {cfg}: {type(e).__name__} {e}"[:200], flush=True)
        best = min(sweep, key=sweep.get) if sweep else None
        row.update(swap_best=best, swap_best_us=sweep.get(best), swap=sweep,
                   cublas_gb_s=round(n * k * 2 / row["cublas_us"] / 1e3, 1))
        print({k_: v for k_, v in row.items() if k_ != "swap"}, flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "bf16_rows.json"))
    args = ap.parse_args()
    rows = [r for n, k in SHAPES for r in one_shape(n, k, args.rows)]
    write_result(args.out, dict(device=torch.cuda.get_device_name(), rows=rows))


if __name__ == "__main__":
    main()
