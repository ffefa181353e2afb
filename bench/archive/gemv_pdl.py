"""Batch-1 decode GEMMs: cuBLAS vs our GEMV kernel, without and with programmatic dependent
launch (kernels/gemv.py). Per shape: each linear alone (distinct weights per layer, nothing from
L2), then the layers' chain qkv -> o (+= stream) -> gate_up -> down (+= stream) over all layers
in one CUDA graph, us per layer beside the bandwidth floor.

    python bench/gemv_pdl.py [--shapes llama-1b llama-8b] [--out bench/results/h200_gemv_pdl.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backend"))
from common import time_graph, write_result  # noqa: E402
from gemm_backends import linears  # noqa: E402
from shapes import SHAPES  # noqa: E402

import hsserve.kernels.gemv as gemv_mod  # noqa: E402
from hsserve.kernels.gemv import gemv, gemv_config  # noqa: E402

TB = 4.28e12  # NOTE: the H200's measured copy bandwidth, bytes/s


def variant(name: str):
    if name == "cublas":
        return lambda x, w, into=None: (torch.mm(x, w.t()) if into is None
                                         else into.addmm_(x, w.t()))
    return lambda x, w, into=None: gemv(x, w, into, pdl=name == "gemv_pdl")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--slabs", type=int, nargs="+", default=[16],
                    help="KB of W per program for the PDL chain (kernels/gemv.py: 16)")
    ap.add_argument("--chain-only", action="store_true")
    args = ap.parse_args()
    dev, dt, results = torch.device("cuda"), torch.bfloat16, []
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        layers, mats = shape["num_hidden_layers"], linears(shape)
        mats.pop("lm_head")
        weights = [{k: torch.randn(n, kk, device=dev, dtype=dt) * 0.02 for k, (n, kk) in mats.items()}
                   for _ in range(layers)]
        h = shape["hidden_size"]
        x = torch.randn(args.rows, h, device=dev, dtype=dt)
        for name, (n, k) in ([] if args.chain_only else mats.items()):
            xin = torch.randn(args.rows, k, device=dev, dtype=dt)
            row = {"shape": shape_name, "linear": name, "n": n, "k": k, "rows": args.rows,
                   "floor_us": round(n * k * 2 / TB * 1e6, 2)}
            ref = torch.mm(xin, weights[0][name].t()).float()
            for v in ("cublas", "gemv", "gemv_pdl"):
                f = variant(v)
                err = (f(xin, weights[0][name]).float() - ref).abs().max().item()
                assert err <= 2e-2 * ref.abs().max().item() + 1e-3, (name, v, err)
                row[v + "_us"] = round(time_graph(lambda i: f(xin, weights[i % layers][name]),
                                                  calls=4 * layers), 2)
            for slab in (8, 32):
                bn, _ = gemv_config(n, k, 2)
                bn = max(1, bn * slab // 16)
                while n % bn:
                    bn //= 2
                for warps in (4, 8):
                    row[f"gemv_b{bn}_w{warps}_us"] = round(time_graph(
                        lambda i: gemv(xin, weights[i % layers][name], pdl=False,
                                       config=(bn, warps)), calls=4 * layers), 2)
            print(row, flush=True)
            results.append(row)
        floor = sum(n * k * 2 for n, k in mats.values()) / TB * 1e6
        chains = [("cublas", 16), ("gemv", 16)] + [("gemv_pdl", kb) for kb in args.slabs]
        for v, kb in chains:
            f = variant(v)
            gemv_mod._SLAB_BYTES = kb << 10

            def chain(_i, f=f):
                for w in weights:
                    qkv = f(x, w["qkv"])
                    f(qkv[:, : w["o"].shape[1]], w["o"], into=x)
                    gu = f(x, w["gate_up"])
                    f(gu[:, : w["down"].shape[1]], w["down"], into=x)

            us = time_graph(chain, calls=1, replays=20) / layers
            row = {"shape": shape_name, "chain": v, "slab_kb": kb, "rows": args.rows,
                   "us_per_layer": round(us, 2), "floor_us_per_layer": round(floor, 2),
                   "over_floor": round(us / floor, 3)}
            print(row, flush=True)
            results.append(row)
        gemv_mod._SLAB_BYTES = 16 << 10
        del weights
        torch.cuda.empty_cache()
    if args.out:
        write_result(args.out, {"benchmark": "gemv_pdl", "rows": results})


if __name__ == "__main__":
    main()
