"""Paged decode attention alone at one batch shape, for each split count (and the count the
engine's heuristic picks): us per call and the KV bytes read per second, against the copy
bandwidth. At batch 64 with the Llama-3.2-1B shape the kernel ran at about half the KV bandwidth
inside the decode graph (12.3 us per layer, commit 65e5e92); this finds whether more splits help.

    python bench/attention_splits.py [--batch 64] [--ctx 192] [--splits 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import time_graph, write_result  # noqa: E402
from hsserve.kernels.paged_decode_attention import choose_num_splits, paged_decode_attention  # noqa: E402


def make_inputs(batch, ctx, heads, kv_heads, head_dim, block_size, dtype, device):
    pages = -(-ctx // block_size)
    blocks = batch * pages + 1
    g = torch.Generator(device="cpu").manual_seed(0)
    kv = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    tables = (torch.randperm(blocks - 1, generator=g)[: batch * pages] + 1).view(batch, pages)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return q, kv, tables.to(device, torch.int32), lens.to(device)


def shape_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch shape's options (1B shape's heads by default)."""
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    return ap


def main() -> None:
    ap = shape_args(argparse.ArgumentParser())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    q, kv, tables, lens = make_inputs(args.batch, args.ctx, args.heads, args.kv_heads,
                                      args.head_dim, args.block_size, torch.bfloat16, "cuda")
    kv_bytes = 2 * args.batch * args.ctx * args.kv_heads * args.head_dim * 2
    picked = choose_num_splits(args.batch, args.kv_heads, tables.shape[1])
    rows = []
    counters = torch.zeros(args.batch * args.kv_heads, dtype=torch.int32, device="cuda")
    for splits in sorted(set(args.splits) | {picked}):
        out = torch.empty_like(q)
        us = time_graph(lambda _, s=splits: paged_decode_attention(q, kv, tables, lens, 0.125,
                                                                  num_splits=s, out=out,
                                                                  counters=counters),
                        args.repeats)
        row = {"splits": splits, "heuristic": splits == picked, "us": round(us, 2),
               "kv_tb_s": round(kv_bytes / us / 1e6, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        write_result(args.out, {"benchmark": "attention_splits", **vars(args), "rows": rows})


if __name__ == "__main__":
    main()
