"""Linear layers of the decode step alone, cuBLAS vs cuBLASLt (torch's preferred BLAS backend),
at the batch sizes given, as CUDA graphs over enough distinct weight copies that nothing is served
from L2 (the decode step reads every weight once). Prints us per call and effective TB/s.

    python bench/gemm_backends.py [--shapes llama-1b llama-8b] [--batches 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import time_graph, write_result  # noqa: E402
from shapes import SHAPES  # noqa: E402


def linears(shape: dict) -> dict[str, tuple[int, int]]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim") or h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, shape["num_attention_heads"] * d), "gate_up": (2 * i, h),
            "down": (h, i), "lm_head": (shape["vocab_size"], h)}


def time_linear(n: int, k: int, m: int, backend: str, budget: int = 1 << 30) -> float:
    torch.backends.cuda.preferred_blas_library(backend)
    copies = max(2, budget // (n * k * 2))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    us = time_graph(lambda i: torch.matmul(x, ws[i].t(), out=out), copies)
    ws.clear()
    torch.cuda.empty_cache()
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for name in args.shapes:
        for layer, (n, k) in linears(SHAPES[name]).items():
            for m in args.batches:
                r = {"shape": name, "linear": layer, "n": n, "k": k, "m": m}
                for backend in ("cublas", "cublaslt"):
                    us = time_linear(n, k, m, backend)
                    r[f"{backend}_us"] = round(us, 2)
                    r[f"{backend}_tb_s"] = round(n * k * 2 / us / 1e6, 2)
                rows.append(r)
                print(json.dumps(r), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.out:
        write_result(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
