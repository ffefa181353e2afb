"""A decode step's expert routing and the pairs' alignment by expert in one program, for the
grouped GEMM of kernels/moe.py (its reference: MoE.route, then align_pairs).

At decode sizes the routing's softmax / top-k / renormalization and align_pairs' ~25 small torch
ops cost more in launches than the experts' weights take to read
(bench/README.md#mixture-of-experts-h200). Here one program takes the router's float64 logits [T, E] and writes each token's
k experts and float32 weights, the pair ids grouped by expert (padding id T * k) and each
block's expert: T * k pairs at most MAX_PAIRS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 128  # NOTE: the pairwise rank below is [pairs, pairs] in registers


@triton.jit
def _route_align_kernel(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, tokens, num_experts,
                        rows, num_blocks, K: tl.constexpr, RENORM: tl.constexpr,
                        E_PAD: tl.constexpr, P_PAD: tl.constexpr, R_PAD: tl.constexpr,
                        B_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    e = tl.arange(0, E_PAD)
    p = tl.arange(0, P_PAD)  # NOTE: pair p = token p // K, slot p % K
    pairs = tokens * K
    token, slot = p // K, p % K
    valid = p < pairs
    # NOTE: routing, per pair's token (each token's row read K times: small)
    real = e[None, :] < num_experts
    lg = tl.load(LOGITS + token[:, None] * num_experts + e[None, :], mask=valid[:, None] & real,
                 other=0.0)  # NOTE: padding pairs read zeros: no NaN
    lg = tl.where(real, lg, float("-inf"))
    lg = lg - tl.max(lg, 1)[:, None]
    ex = tl.exp(lg)
    probs = (ex / tl.sum(ex, 1)[:, None]).to(tl.float32)
    probs = tl.where(real, probs, -1.0)
    chosen = tl.zeros((P_PAD,), dtype=tl.int32)
    weight = tl.zeros((P_PAD,), dtype=tl.float32)
    total = tl.zeros((P_PAD,), dtype=tl.float32)
    for j in tl.static_range(K):  # NOTE: the j-th largest, lowest index on ties
        best = tl.max(probs, 1)
        idx = tl.min(tl.where(probs == best[:, None], e[None, :], E_PAD), 1)
        chosen = tl.where(slot == j, idx, chosen)
        weight = tl.where(slot == j, best, weight)
        total += best
        probs = tl.where(e[None, :] == idx[:, None], -2.0, probs)
    if RENORM:
        weight = weight / total
    tl.store(WEIGHTS + p, weight, mask=valid)
    tl.store(EXPERTS + p, chosen.to(tl.int64), mask=valid)
    # NOTE: alignment: counts per expert, each pair's rank among its expert's, padded groups
    hot = ((chosen[:, None] == e[None, :]) & valid[:, None]).to(tl.int32)
    counts = tl.sum(hot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    q = tl.arange(0, P_PAD)
    chosen_q = tl.where(q < pairs, chosen, -1)
    same = (chosen_q[None, :] == chosen[:, None]) & (q[None, :] < p[:, None])
    rank = tl.sum(same.to(tl.int32), 1)
    dest = tl.sum(hot * starts[None, :], 1) + rank
    r = tl.arange(0, R_PAD)
    tl.store(IDS + r, tl.zeros((R_PAD,), dtype=tl.int64) + pairs, mask=r < rows)
    tl.debug_barrier()  # NOTE: the padding ids first, then the pairs over them
    tl.store(IDS + dest, p.to(tl.int64), mask=valid)
    b = tl.arange(0, B_PAD)
    before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < num_experts)
    tl.store(BLOCK_EXPERT + b, tl.sum(before.to(tl.int64), 1), mask=b < num_blocks)


def route_align(logits: torch.Tensor, k: int, renormalize: bool, block_m: int):
    """float64 router logits [T, E] -> (weights [T, k] float32, experts [T, k], pair ids grouped
    by expert, each block's expert): MoE.route and align_pairs in one launch."""
    tokens, num_experts = logits.shape
    pairs = tokens * k
    assert pairs <= MAX_PAIRS, "route_align is for decode sizes"
    rows = -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m
    dev = logits.device
    weights = torch.empty(tokens, k, dtype=torch.float32, device=dev)
    experts = torch.empty(tokens, k, dtype=torch.int64, device=dev)
    ids = torch.empty(rows, dtype=torch.int64, device=dev)
    block_expert = torch.empty(rows // block_m, dtype=torch.int64, device=dev)
    _route_align_kernel[(1,)](
        logits.contiguous(), weights, experts, ids, block_expert, tokens, num_experts, rows,
        rows // block_m, K=k, RENORM=renormalize, E_PAD=triton.next_power_of_2(num_experts),
        P_PAD=max(16, triton.next_power_of_2(pairs)), R_PAD=triton.next_power_of_2(rows),
        B_PAD=max(16, triton.next_power_of_2(rows // block_m)), BLOCK_M=block_m)
    return weights, experts, ids, block_expert
