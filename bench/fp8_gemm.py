"""The float8 GEMM's launch configs (kernels/fp8.py gemm_config) swept at the Llama-3.1-8B / 70B
linears' shapes, batched-decode and prefill rows, against bf16 cuBLAS on the same shapes.

    python3 bench/fp8_gemm.py [--out FILE]

Each (rows, N, K) times the GEMM kernel (weights only: x bf16) under every candidate
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), fp8_gemm as the engine runs it (its gemm_config, or
from DEQUANT_ROWS rows the weight widened + cuBLAS), and torch's bf16 x @ W^T, by CUDA events;
prints the best config per shape and writes every timing (default bench/results/fp8_gemm.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402

import hsserve.kernels.fp8 as fp8  # noqa: E402
from hsserve.models.fp8 import quantize  # noqa: E402

SHAPES = [(n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                              (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672))]
ROWS = (16, 64, 2048)
CANDIDATES = {
    16: [(16, 64, 128, 4, 4), (16, 32, 256, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4),
         (16, 32, 128, 4, 4)],
    64: [(64, 64, 64, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (32, 64, 128, 4, 4),
         (64, 128, 64, 4, 4), (64, 32, 256, 4, 3), (32, 32, 256, 4, 4), (64, 128, 128, 8, 3),
         (64, 64, 128, 4, 5), (64, 64, 256, 8, 3)],
    2048: [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (256, 128, 64, 8, 3),
           (128, 256, 128, 8, 3), (64, 256, 64, 4, 4), (128, 128, 64, 4, 4), (128, 64, 128, 4, 4)],
}
SWAP = [(bw, bk, warps, stages) for bw, warps in ((64, 4), (128, 4), (256, 8)) for bk in (64, 128)
        for stages in (3, 4)]
SPLITS = (1, 2, 4, 8)


def sweep_swap(x, w8, scales) -> dict:
    """The swapped GEMM (kernels/fp8.py swap_config) under every candidate and K split."""
    m, times, default = x.shape[0], {}, fp8.swap_config
    for bw, bk, warps, stages in SWAP:
        for splits in SPLITS:
            cfg = (bw, m, bk, splits, warps, stages)
            fp8.swap_config = lambda *_a, cfg=cfg: cfg
            try:
                times[cfg] = event_ms(lambda: fp8.fp8_gemm(x, w8, scales), 20)
            except Exception as e:  # noqa: BLE001 - a config past shared memory: skipped
                print(f"swap {cfg}: {type(e).__name__}", flush=True)
    fp8.swap_config = default
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "fp8_gemm.json"))
    args = ap.parse_args()
    rows = []
    default, dequant_rows = fp8.gemm_config, fp8.DEQUANT_ROWS
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w8, s = quantize(w)
        scales = fp8.Fp8Scales(s)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = event_ms(lambda: x @ w.T, 20)
            fp8.DEQUANT_ROWS = 1 << 30  # NOTE: the kernel itself under each config
            times = {}
            for cfg in CANDIDATES[m]:
                fp8.gemm_config = lambda *_a, cfg=cfg: cfg
                try:
                    times[cfg] = event_ms(lambda: fp8.fp8_gemm(x, w8, scales), 20)
                except Exception as e:  # noqa: BLE001 - a config past shared memory: skipped
                    print(f"{m}x{n}x{k} {cfg}: {type(e).__name__}", flush=True)
            swap = sweep_swap(x, w8, scales) if m in CANDIDATES and m <= 64 else {}
            fp8.gemm_config, fp8.DEQUANT_ROWS = default, dequant_rows
            cfg = min(times, key=times.get)
            sw = min(swap, key=swap.get) if swap else None
            served = event_ms(lambda: fp8.fp8_gemm(x, w8, scales), 20)  # NOTE: as the engine runs it
            row = {"m": m, "n": n, "k": k, "bf16_ms": round(bf16, 4),
                   "default": list(default(m, n, k, False)), "served_ms": round(served, 4),
                   "served_over_bf16": round(served / bf16, 3),
                   "best": list(cfg), "best_ms": round(times[cfg], 4),
                   "best_over_bf16": round(times[cfg] / bf16, 3),
                   "swap_best": list(sw) if sw else None,
                   "swap_best_ms": round(swap[sw], 4) if sw else None,
                   "swap_over_bf16": round(swap[sw] / bf16, 3) if sw else None,
                   "swap": {",".join(map(str, c)): round(t, 4) for c, t in swap.items()},
                   "all": {",".join(map(str, c)): round(t, 4) for c, t in times.items()}}
            print({k_: v for k_, v in row.items() if k_ not in ("all", "swap")}, flush=True)
            rows.append(row)
        del w, w8
    write_result(args.out, {"benchmark": "fp8_gemm", "rows": rows})


if __name__ == "__main__":
    main()
