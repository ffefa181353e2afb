"""A mixture-of-experts layer's decode pieces on the GPU, Qwen3-30B-A3B shape (hidden 2048, 128
experts, top 8, intermediate 768, bf16, random weights and routers): the router's float64 logits
(router_logits at decode sizes, beside MoE.logits' cast + cuBLAS as "torch"), route_align, the
gate_up and down grouped GEMMs, the pairs' sum, and the whole MoE.forward (also as the folded
layers run it: the residual stream in, the output added into it). Each is timed inside a
captured CUDA graph over `--layers` distinct layers (nothing from L2, launch cost as in the
engine; at batch 1 chained by PDL as there), for its default launch config and a neighbour of it
in each knob (at batch 1 a wider set of GEMM tiles): every candidate checked against the
default's result, one JSON line per (batch, piece, config), then the best config per piece
beside the default.

    python bench/moe_kernels.py [--batches 1 64] [--layers 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backend"))
from common import time_graph, write_result  # noqa: E402
from shapes import SHAPES  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from hsserve.kernels.moe import (SUM_CONFIG, GemmConfig, _grouped_gemm,  # noqa: E402
                                 align_pairs, block_rows, gemm_config, sum_pairs)
from hsserve.kernels.moe_route import (ROUTER_EXPERTS, route_align,  # noqa: E402
                                       route_warps, router_logits, routes_in_kernel)
from hsserve.kernels.pdl import pdl_on  # noqa: E402
from hsserve.models.moe import MoE  # noqa: E402
from hsserve.models.spec import ModelSpec  # noqa: E402

TB = 4.25e12  # NOTE: the H200's measured copy bandwidth, bytes/s
DEVICE = "cuda"
ROUTE_CONFIGS = [2, 4, 8, 16]  # NOTE: route_align's num_warps
SUM_CONFIGS = [(128, 1), (256, 1), (256, 2)]
ROUTER_CONFIGS = [1, 2, 4, 8]  # NOTE: router_logits' rows a program
# NOTE: batch 1's wider GEMM set: (block_n, block_k, warps, stages), narrow tiles for more programs
DECODE_GEMMS = [(64, 128, 4, 4), (32, 128, 2, 4), (64, 128, 4, 5), (32, 128, 2, 5), (32, 128, 2, 3),
                (64, 128, 4, 6), (64, 256, 8, 3), (32, 256, 4, 3), (32, 256, 2, 3), (64, 128, 2, 5),
                (32, 128, 4, 4), (16, 128, 2, 5)]


def build(layers: int) -> list[MoE]:
    spec = ModelSpec.from_hf_dict(SHAPES["qwen3-30b-a3b"])
    out = []
    with torch.device(DEVICE):
        for _ in range(layers):
            moe = MoE(spec).to(torch.bfloat16)
            for p in (moe.router, moe.gate_up, moe.down):
                p.data.normal_(0, 0.02)
            moe.prepare()
            out.append(moe)
    return out


def emit(rows: list, **row) -> dict:
    if isinstance(row.get("config"), GemmConfig):
        row["config"] = row["config"]._asdict()
    print(json.dumps(row), flush=True)
    rows.append(row)
    return row


def sweep(rows, batch, piece, configs, run, check, floor_us, calls) -> dict | None:
    """Times run(layer, config) per config inside one graph over the layers, each result checked
    (check(got, default's, config)) first. -> the fastest row."""
    ref = [run(i, None) for i in range(calls)]
    timed = []
    for cfg in configs:
        try:
            outs = [run(i, cfg) for i in range(calls)]
        except OutOfResources as e:  # NOTE: a candidate too big for the SM is no failure
            emit(rows, batch=batch, piece=piece, config=cfg, skipped=str(e)[:120])
            continue
        for got, want in zip(outs, ref):
            check(got, want, cfg)
        us = time_graph(lambda i, cfg=cfg: run(i % calls, cfg), calls=2 * calls, replays=20)
        timed.append(emit(rows, batch=batch, piece=piece, config=cfg, us=round(us, 2),
                          floor_us=round(floor_us, 2)))
    return min(timed, key=lambda r: r["us"]) if timed else None


def close(got, want, cfg, tol=2e-2):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * want.float().abs().max().item() + 1e-3, (cfg, err)


def equal(got, want, cfg):
    for a, b in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b), cfg


def finite(got, want, cfg):
    """For what runs in place (each run adds into the last one's result): no inf or NaN."""
    assert torch.isfinite(got).all(), cfg


def same_routing(got, want, cfg):
    """The same experts and alignment; weights to float32 rounding (sums in another order)."""
    equal(got[1:], want[1:], cfg)
    assert torch.allclose(got[0], want[0], rtol=1e-6, atol=0), cfg


def torch_or_equal(tol: float):
    """Checks a kernel config's result bitwise, the torch baseline's ("torch") within tol."""
    def check(got, want, cfg):
        if cfg == "torch":
            assert (got - want).abs().max().item() <= tol * want.abs().max().item(), cfg
        else:
            equal(got, want, cfg)
    return check


def gemm_neighbours(base: GemmConfig, batch: int) -> list[GemmConfig]:
    """The default, then one knob at a time moved a step (stages: the other size's, 3 <-> 4);
    at batch 1 DECODE_GEMMS besides."""
    near = [base, base._replace(block_n=32), base._replace(block_k=64),
            base._replace(num_warps=2), base._replace(num_stages=7 - base.num_stages)]
    wide = [GemmConfig(*c) for c in DECODE_GEMMS] if batch == 1 else []
    return near + [c for c in wide if c not in near]


def close64(got, want, cfg):
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item(), cfg


def route_torch(logits: torch.Tensor, k: int, num_experts: int, block_m: int):
    """MoE.route after the logits, then align_pairs: the path above routes_in_kernel's sizes."""
    weights, experts = torch.topk(torch.softmax(logits, dim=-1).float(), k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights, experts, *align_pairs(experts, num_experts, block_m))


def bench_routing(moes, xs, batch, rows, best, defaults):
    """The router's logits, then route_align (beside the torch routing, "torch"; above
    routes_in_kernel's sizes that alone) -> each layer's (weights, experts, pair ids, block
    experts)."""
    calls, k, (e, hidden) = len(moes), moes[0].top_k, moes[0].router.shape
    block_m, pdl = block_rows(batch * k), pdl_on(xs[0])
    if routes_in_kernel(batch, k, e):
        def router(i, cfg):
            if cfg == "torch":
                return moes[i].logits(xs[i])
            return router_logits(xs[i], moes[i].router, pdl, cfg)

        defaults["router"] = ROUTER_EXPERTS
        best["router"] = sweep(rows, batch, "router", ROUTER_CONFIGS + ["torch"], router, close64,
                               e * hidden * 2 / TB * 1e6, calls)
        lg = [router(i, None) for i in range(calls)]

        def route(i, warps):
            if warps == "torch":
                return route_torch(lg[i], k, e, block_m)
            return route_align(lg[i], k, True, block_m, warps, pdl)

        defaults["route_align"] = route_warps(batch, k, e)
        best["route_align"] = sweep(rows, batch, "route_align", ROUTE_CONFIGS + ["torch"], route,
                                    same_routing, 0, calls)
    else:
        best["router"] = sweep(rows, batch, "router", [None], lambda i, _c: moes[i].logits(xs[i]),
                               equal, e * hidden * 8 / TB * 1e6, calls)
        lg = [moes[i].logits(xs[i]) for i in range(calls)]

        def route(i, _cfg):
            return route_torch(lg[i], k, e, block_m)

        best["route_torch"] = sweep(rows, batch, "route_torch", [None], route, equal, 0, calls)
    return [route(i, None) for i in range(calls)]


def bench_experts(moes, xs, batch, routed, rows, best, defaults) -> float:
    """gate_up, down, the pairs' sum -> the experts a layer reads (mean over the layers)."""
    calls, m = len(moes), moes[0]
    k, hidden, inter = m.top_k, m.gate_up.shape[2], m.down.shape[2]
    pairs, block_m, pdl = batch * k, block_rows(batch * k), pdl_on(xs[0])
    used = sum(len(torch.unique(r[1])) for r in routed) / calls

    def gate_up(i, cfg):
        _, _, ids, blocks = routed[i]
        return _grouped_gemm(xs[i], moes[i].gate_up, ids, blocks, pairs, inter, k, True, None,
                             block_m, cfg, pdl)

    defaults["gate_up"], defaults["down"] = gemm_config(pairs, True), gemm_config(pairs, False)
    best["gate_up"] = sweep(rows, batch, "gate_up", gemm_neighbours(defaults["gate_up"], batch),
                            gate_up, close, used * 2 * inter * hidden * 2 / TB * 1e6, calls)
    hs = [gate_up(i, None) for i in range(calls)]

    def down(i, cfg):
        w, _, ids, blocks = routed[i]
        return _grouped_gemm(hs[i], moes[i].down, ids, blocks, pairs, hidden, 1, False,
                             w.reshape(-1), block_m, cfg, pdl)

    best["down"] = sweep(rows, batch, "down", gemm_neighbours(defaults["down"], batch), down, close,
                         used * inter * hidden * 2 / TB * 1e6, calls)
    ys = [down(i, None) for i in range(calls)]

    def summed(i, cfg):
        if cfg == "torch":
            return ys[i].view(batch, k, -1).sum(1)
        return sum_pairs(ys[i], k, cfg, pdl)

    defaults["sum"] = SUM_CONFIG
    best["sum"] = sweep(rows, batch, "sum", SUM_CONFIGS + ["torch"], summed, torch_or_equal(1e-2),
                        0, calls)
    return used


def bench_batch(moes: list[MoE], batch: int, rows: list) -> None:
    """Every piece's sweep, the whole forward, then each piece's best beside its default."""
    m = moes[0]
    (e, hidden), inter = m.router.shape, m.down.shape[2]
    g = torch.Generator(device=DEVICE).manual_seed(batch)
    xs = [torch.randn(batch, hidden, device=DEVICE, generator=g).bfloat16() for _ in moes]
    best, defaults = {}, {}
    routed = bench_routing(moes, xs, batch, rows, best, defaults)
    used = bench_experts(moes, xs, batch, routed, rows, best, defaults)
    floor = (e * hidden * 2 + used * 3 * inter * hidden * 2) / TB * 1e6
    best["forward"] = sweep(rows, batch, "forward", [None], lambda i, _c: moes[i](xs[i]), equal,
                            floor, len(moes))
    # NOTE: as the folded layers run it: the stream in, normed by the router, the sum added into it
    streams = [x.clone() for x in xs]
    best["forward_folded"] = sweep(rows, batch, "forward_folded", [None],
                                   lambda i, _c: moes[i](streams[i], folded_eps=1e-6), finite,
                                   floor, len(moes))
    for piece, row in best.items():
        default = defaults.get(piece)
        default = default._asdict() if isinstance(default, GemmConfig) else default
        mine = [r for r in rows if r.get("batch") == batch and r.get("piece") == piece
                and r.get("config") == default and "us" in r]
        emit(rows, batch=batch, piece=piece, best=row["config"], best_us=row["us"],
             default=default, default_us=mine[0]["us"] if mine else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--layers", type=int, default=8, help="distinct layers a graph cycles over")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    start, rows = time.time(), []
    moes = build(args.layers)
    for batch in args.batches:
        bench_batch(moes, batch, rows)
        if args.out:
            write_result(args.out, {"benchmark": "moe_kernels", "shape": "qwen3-30b-a3b",
                                    "rows": rows})
    print(json.dumps({"done_s": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
