"""Does pulling the next weights into L2 while attention runs shorten a decode layer? (H200: 50 MB
L2; the 1B shape's o_proj is 8 MB, gate_up 32 MB.) One CUDA graph of 16 layers of the 1B shape,
each: qkv GEMM, paged decode attention, o GEMM, gate_up GEMM, down GEMM; variants:
  plain        as above
  touch_o      a side stream loads o_proj into L2 (evict_last) while attention runs; joined
               before the o GEMM
  touch_o_gu   the same for o_proj and gate_up
  pf_o_gu      PTX prefetch.global.L2 (no registers, no wait for the data) of o_proj and gate_up
Prints us per layer for each variant at batch 1 and 64.

    python bench/l2_prefetch.py --out bench/results/h200_l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backend"))
from attention_splits import make_inputs  # noqa: E402
from common import time_graph, write_result  # noqa: E402
from hsserve.kernels.paged_decode_attention import paged_decode_attention  # noqa: E402


@triton.jit
def _touch_kernel(P, N, OUT, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        off = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(P + off, mask=off < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    total = tl.sum(acc)
    tl.store(OUT + pid, total, mask=total != total)  # NOTE: only for NaN: keeps the loads alive


@triton.jit
def _prefetch_kernel(P, N, OUT, LINES: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(ITERS):
        line = (pid * ITERS + i) * LINES + tl.arange(0, LINES)
        ptrs = P + line.to(tl.int64) * 64  # NOTE: one 128-byte line of bf16 per element
        r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(OUT + pid + line * 0, r, mask=line < 0)


def touch(w: torch.Tensor, out: torch.Tensor, programs: int, prefetch: bool) -> None:
    n = w.numel()
    if prefetch:
        lines = -(-n // 64)
        iters = -(-lines // (programs * 256))
        _prefetch_kernel[(programs,)](w, n, out, LINES=256, ITERS=iters)
    else:
        iters = -(-n // (programs * 2048))
        _touch_kernel[(programs,)](w, n, out, BLOCK=2048, ITERS=iters)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--programs", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    h, inter = 2048, 8192
    mk = lambda *s: torch.randn(*s, device=dev, dtype=bf) * 0.02  # noqa: E731
    layers = [dict(qkv=mk(3072, h), o=mk(h, h), gu=mk(2 * inter, h), down=mk(h, inter))
              for _ in range(args.layers)]
    sink = torch.zeros(1024, device=dev)
    side = torch.cuda.Stream()
    rows = []
    for m in args.batches:
        q, kv, tables, lens = make_inputs(m, args.ctx, 32, 8, 64, 16, bf, dev)
        x = mk(m, h)
        attn_out = torch.empty_like(q)
        qkv_out, gu_out = torch.empty(m, 3072, device=dev, dtype=bf), torch.empty(m, 2 * inter, device=dev, dtype=bf)
        o_out, d_out = torch.empty(m, h, device=dev, dtype=bf), torch.empty(m, h, device=dev, dtype=bf)

        def step(variant: str, programs: int) -> None:
            for L in layers:
                torch.matmul(x, L["qkv"].t(), out=qkv_out)
                if variant != "plain":
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        pf = variant.startswith("pf")
                        touch(L["o"], sink, programs, pf)
                        if variant.endswith("gu"):
                            touch(L["gu"], sink, programs, pf)
                paged_decode_attention(q, kv, tables, lens, 0.125, out=attn_out)
                if variant != "plain":
                    torch.cuda.current_stream().wait_stream(side)
                torch.matmul(attn_out.view(m, -1), L["o"].t(), out=o_out)
                torch.matmul(o_out, L["gu"].t(), out=gu_out)
                torch.matmul(gu_out[:, :inter], L["down"].t(), out=d_out)

        for variant in ("plain", "touch_o", "touch_o_gu", "pf_o", "pf_o_gu"):
            for programs in ([0] if variant == "plain" else args.programs):
                us = time_graph(lambda _, v=variant, p=programs: step(v, p), 1, replays=20)
                us /= args.layers
                row = {"batch": m, "variant": variant, "programs": programs, "us_per_layer": round(us, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        write_result(args.out, {"benchmark": "l2_prefetch", **vars(args), "rows": rows})


if __name__ == "__main__":
    main()
