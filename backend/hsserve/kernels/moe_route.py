"""A decode step's expert routing on CUDA, for the grouped GEMM of kernels/moe.py: the router's
float64 logits (router_logits; its reference: F.linear in float64), then the routing and the
pairs' alignment by expert in one program (route_align; its reference: MoE.route, then
align_pairs). Both chain by programmatic dependent launch (kernels/pdl.py) at one row.

At decode sizes the routing's softmax / top-k / renormalization and align_pairs' ~25 small torch
ops cost more in launches than the experts' weights take to read
(bench/README.md#mixture-of-experts-h200). route_align takes the logits [T, E] and writes each
token's k experts and float32 weights, the pair ids grouped by expert (padding id T * k) and each
block's expert: T * k pairs at most MAX_PAIRS. At one token decode_route does it all in the
router's launch: its last program to finish (a ticket counter) routes, one launch fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.moe import aligned_rows
from hsserve.kernels.pdl import pdl_enter

MAX_PAIRS = 128  # NOTE: the pairwise rank below is [pairs, pairs] in registers
ROUTE_WARPS = 4  # NOTE: the fastest at decode sizes (bench/moe_kernels.py): 1 or 2 are slower
ONE_EXPERTS = 256  # NOTE: the one-token kernel's ranks are [E, E] in registers
ROUTER_EXPERTS = 2  # NOTE: router rows a program (bench/moe_kernels.py); fixed: it shapes sums


@triton.jit
def _router_kernel(X, W, OUT, XN, TICKET, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, K,
                   stride_x, stride_w, eps, rows, BLOCK_E: tl.constexpr, KP: tl.constexpr,
                   NORM: tl.constexpr, ROUTE_K: tl.constexpr, RENORM: tl.constexpr,
                   E_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                   PDL: tl.constexpr):
    """OUT[t, e] = sum_k X[t, k] W[e, k] in float64, for one token and BLOCK_E experts. NORM: X is
    the residual stream, RMS-normed here (no weight: it is in W) and written to XN. ROUTE_K > 0
    (one token): the last program to finish routes the token (_route_one)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rk = tl.arange(0, KP)
    w = tl.load(W + e[:, None].to(tl.int64) * stride_w + rk[None, :],
                mask=(e[:, None] < num_experts) & (rk[None, :] < K), other=0.0)
    pdl_enter(PDL)  # NOTE: x comes from the kernel before; the router's rows did not
    x = tl.load(X + t * stride_x + rk, mask=rk < K, other=0.0)
    if NORM:  # NOTE: add_rmsnorm's formula: float32, one rounding
        xf = x.to(tl.float32)
        x = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / K + eps)).to(XN.dtype.element_ty)
        if tl.program_id(1) == 0:
            tl.store(XN + t * stride_x + rk, x, mask=rk < K)
    # NOTE: both widened exactly, so each product is exact; one program per token and the same
    # reduction for every row of the tile: a logit's bits do not depend on the batch, the row's
    # place in it or the launch, and identical router rows tie exactly
    logits = tl.sum(w.to(tl.float64) * x.to(tl.float64)[None, :], axis=1)
    tl.store(OUT + t * num_experts + e, logits, mask=e < num_experts)
    if ROUTE_K > 0:
        tl.debug_barrier()  # NOTE: every thread's logits stored before the ticket is taken
        if tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
            tl.store(TICKET, 0)  # NOTE: the last one: zero again for the next launch
            _route_one(OUT, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, rows, ROUTE_K,
                       RENORM, E_PAD, R_PAD, BLOCK_M)


def router_logits(x: torch.Tensor, w: torch.Tensor, pdl: bool = False,
                  block_e: int | None = None, norm_eps: float | None = None,
                  normed: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] and the router's rows w [E, H] (float dtypes of the model) -> float64 logits
    [T, E], as F.linear(x.double(), w.double()) to float64 rounding. norm_eps: x is the residual
    stream, RMS-normed (no weight) into `normed` (x's shape and dtype) and the logits of that."""
    out = torch.empty(len(x), w.shape[0], dtype=torch.float64, device=x.device)
    _launch_router(x, w, out, normed, norm_eps, None, pdl, block_e)
    return out


def _launch_router(x, w, out, normed, norm_eps, route, pdl, block_e=None):
    """route: (ticket, weights, experts, ids, block_expert, k, renormalize, block_m) or None."""
    tokens, hidden = x.shape
    num_experts = w.shape[0]
    assert w.shape[1] == hidden and x.stride(1) == 1 and w.stride(1) == 1
    assert normed is None or normed.stride() == x.stride()
    block_e = block_e or ROUTER_EXPERTS
    kp = triton.next_power_of_2(hidden)
    warps = min(16, max(1, block_e * kp // 1024))  # NOTE: ~32 float64 products a thread
    ticket, weights, experts, ids, blocks, k, renorm, block_m = route or (out,) * 5 + (0, 0, 1)
    rows = len(ids) if route else 1
    _router_kernel[(tokens, triton.cdiv(num_experts, block_e))](
        x, w, out, normed if normed is not None else x, ticket, weights, experts, ids, blocks,
        num_experts, hidden, x.stride(0), w.stride(0), norm_eps or 0.0, rows, BLOCK_E=block_e,
        KP=kp, NORM=norm_eps is not None, ROUTE_K=k, RENORM=bool(renorm),
        E_PAD=triton.next_power_of_2(num_experts), R_PAD=triton.next_power_of_2(rows),
        BLOCK_M=block_m, PDL=pdl, num_warps=warps, launch_pdl=pdl)


@triton.jit
def _keys(probs, e, real, E_PAD: tl.constexpr):
    """Each expert's sort key: its probability's bits (>= 0: ordered as the floats) over its
    index reversed, so the largest key is the largest probability, the lowest index on a tie;
    -1 where not real (never chosen)."""
    return tl.where(real, (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - e),
                    -1)


@triton.jit
def _route_align_kernel(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, tokens, num_experts,
                        rows, num_blocks, K: tl.constexpr, RENORM: tl.constexpr,
                        E_PAD: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr,
                        R_PAD: tl.constexpr, B_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_enter(PDL)
    e = tl.arange(0, E_PAD)
    t = tl.arange(0, T_PAD)
    j = tl.arange(0, K_PAD)
    real = e[None, :] < num_experts
    lg = tl.load(LOGITS + t[:, None] * num_experts + e[None, :],
                 mask=(t[:, None] < tokens) & real, other=0.0)  # NOTE: padding rows: no NaN
    lg = tl.where(real, lg, float("-inf"))
    lg = lg - tl.max(lg, 1)[:, None]
    ex = tl.exp(lg)
    probs = (ex / tl.sum(ex, 1)[:, None]).to(tl.float32)
    key = _keys(probs, e[None, :], real, E_PAD)
    chosen = tl.zeros((T_PAD, K_PAD), dtype=tl.int32)
    weight = tl.zeros((T_PAD, K_PAD), dtype=tl.float32)
    total = tl.zeros((T_PAD,), dtype=tl.float32)
    for s in tl.static_range(K):
        best = tl.max(key, 1)
        hi = best >> 32
        idx = (E_PAD - 1 - (best - (hi << 32))).to(tl.int32)
        prob = hi.to(tl.int32).to(tl.float32, bitcast=True)
        chosen = tl.where(j[None, :] == s, idx[:, None], chosen)
        weight = tl.where(j[None, :] == s, prob[:, None], weight)
        total += prob
        key = tl.where(e[None, :] == idx[:, None], -1, key)
    if RENORM:
        weight = weight / total[:, None]
    mine = (t[:, None] < tokens) & (j[None, :] < K)
    tl.store(WEIGHTS + t[:, None] * K + j[None, :], weight, mask=mine)
    tl.store(EXPERTS + t[:, None] * K + j[None, :], chosen.to(tl.int64), mask=mine)
    _align(IDS, BLOCK_EXPERT, tl.reshape(tl.where(mine, chosen, -1), (T_PAD * K_PAD,)),
           tl.reshape(t[:, None] * K + j[None, :], (T_PAD * K_PAD,)), tokens * K, num_experts,
           rows, num_blocks, E_PAD, T_PAD * K_PAD, R_PAD, B_PAD, BLOCK_M)


@triton.jit
def _align(IDS, BLOCK_EXPERT, chosen, pair, pairs, num_experts, rows, num_blocks,
           E_PAD: tl.constexpr, P_PAD: tl.constexpr, R_PAD: tl.constexpr,
           B_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """align_pairs over the pairs in (token, slot) order: chosen -1 for padding."""
    e = tl.arange(0, E_PAD)
    p = tl.arange(0, P_PAD)
    valid = chosen >= 0
    hot = (chosen[:, None] == e[None, :]).to(tl.int32)
    counts = tl.sum(hot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    same = (chosen[None, :] == chosen[:, None]) & (p[None, :] < p[:, None])
    rank = tl.sum(same.to(tl.int32), 1)  # NOTE: among its expert's pairs, in pair order
    dest = tl.sum(hot * starts[None, :], 1) + rank
    r = tl.arange(0, R_PAD)
    tl.store(IDS + r, tl.zeros((R_PAD,), dtype=tl.int64) + pairs, mask=r < rows)
    tl.debug_barrier()  # NOTE: the padding ids first, then the pairs over them
    tl.store(IDS + dest, pair.to(tl.int64), mask=valid)
    b = tl.arange(0, B_PAD)
    before = (ends[None, :] <= (b * BLOCK_M)[:, None]) & (e[None, :] < num_experts)
    tl.store(BLOCK_EXPERT + b, tl.sum(before.to(tl.int64), 1), mask=b < num_blocks)


@triton.jit
def _route_one_kernel(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, rows,
                      K: tl.constexpr, RENORM: tl.constexpr, E_PAD: tl.constexpr,
                      R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    _route_one(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, rows, K, RENORM, E_PAD,
               R_PAD, BLOCK_M)


@triton.jit
def _route_one(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, rows, K: tl.constexpr,
               RENORM: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """_route_align_kernel for one token: each expert's rank among the keys in one pass (no
    k rounds of a maximum), and its group is a block of its own (k blocks, in expert order)."""
    e = tl.arange(0, E_PAD)
    real = e < num_experts
    # NOTE: from L2 (.cg): in the router kernel other programs wrote the logits
    lg = tl.load(LOGITS + e, mask=real, other=float("-inf"), cache_modifier=".cg")
    ex = tl.exp(lg - tl.max(lg, 0))
    probs = (ex / tl.sum(ex, 0)).to(tl.float32)
    # NOTE: the keys are distinct (the index is in them); rank: how many beat it, so the k chosen
    # are ranks 0..k-1, in the slots' order
    key = _keys(probs, e, real, E_PAD)
    rank = tl.sum((key[None, :] > key[:, None]).to(tl.int32), 1)
    chosen = real & (rank < K)
    weight = probs
    if RENORM:
        weight = probs / tl.sum(tl.where(chosen, probs, 0.0), 0)
    tl.store(WEIGHTS + rank, weight, mask=chosen)
    tl.store(EXPERTS + rank, e.to(tl.int64), mask=chosen)
    block = tl.cumsum(chosen.to(tl.int32), 0) - 1  # NOTE: chosen experts before it, itself too
    r = tl.arange(0, R_PAD)
    tl.store(IDS + r, tl.zeros((R_PAD,), dtype=tl.int64) + K, mask=r < rows)
    tl.debug_barrier()  # NOTE: the padding ids first, then each block's one pair over them
    tl.store(IDS + block * BLOCK_M, rank.to(tl.int64), mask=chosen)
    tl.store(BLOCK_EXPERT + block, e.to(tl.int64), mask=chosen)


def _pads(tokens: int, k: int) -> tuple[int, int]:
    """(T_PAD, K_PAD): powers of two, at least 16 pairs and 2 slots."""
    k_pad = max(2, triton.next_power_of_2(k))
    return max(triton.next_power_of_2(tokens), triton.cdiv(16, k_pad)), k_pad


def route_align(logits: torch.Tensor, k: int, renormalize: bool, block_m: int,
                num_warps: int | None = None, pdl: bool = False, one: bool | None = None):
    """float64 router logits [T, E] -> (weights [T, k] float32, experts [T, k], pair ids grouped
    by expert, each block's expert): MoE.route and align_pairs in one launch. num_warps: None
    for ROUTE_WARPS; one: the one-token kernel (None: when T is 1 and E at most ONE_EXPERTS)."""
    tokens, num_experts = logits.shape
    pairs = tokens * k
    assert pairs <= MAX_PAIRS, "route_align is for decode sizes"
    rows = aligned_rows(pairs, num_experts, block_m)
    weights, experts, ids, block_expert = _routed(tokens, k, rows, block_m, logits.device)
    e_pad = triton.next_power_of_2(num_experts)
    if one is None:
        one = tokens == 1 and e_pad <= ONE_EXPERTS
    if one:
        assert tokens == 1 and rows == k * block_m  # NOTE: k <= E: one block per chosen expert
        _route_one_kernel[(1,)](
            logits.contiguous(), weights, experts, ids, block_expert, num_experts, rows, K=k,
            RENORM=renormalize, E_PAD=e_pad, R_PAD=triton.next_power_of_2(rows),
            BLOCK_M=block_m, PDL=pdl, num_warps=num_warps or ROUTE_WARPS, launch_pdl=pdl)
        return weights, experts, ids, block_expert
    t_pad, k_pad = _pads(tokens, k)
    _route_align_kernel[(1,)](
        logits.contiguous(), weights, experts, ids, block_expert, tokens, num_experts, rows,
        rows // block_m, K=k, RENORM=renormalize, E_PAD=e_pad,
        T_PAD=t_pad, K_PAD=k_pad, R_PAD=triton.next_power_of_2(rows),
        B_PAD=max(16, triton.next_power_of_2(rows // block_m)), BLOCK_M=block_m, PDL=pdl,
        num_warps=num_warps or ROUTE_WARPS, launch_pdl=pdl)
    return weights, experts, ids, block_expert


def _routed(tokens: int, k: int, rows: int, block_m: int, dev: torch.device):
    """Room for the routing: (weights, experts, pair ids, each block's expert)."""
    return (torch.empty(tokens, k, dtype=torch.float32, device=dev),
            torch.empty(tokens, k, dtype=torch.int64, device=dev),
            torch.empty(rows, dtype=torch.int64, device=dev),
            torch.empty(rows // block_m, dtype=torch.int64, device=dev))


def decode_route(x: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool, block_m: int,
                 pdl: bool = False, norm_eps: float | None = None,
                 ticket: torch.Tensor | None = None):
    """A decode step's routing of the rows x [T, H] -> (the rows the experts read, route_align's
    four tensors). norm_eps: x is the residual stream, RMS-normed by the router (the norm's weight
    is in w and the experts'). With a ticket (int32 [1], zero; zero again after), one token and
    at most ONE_EXPERTS experts: one launch, the router's last program routing; else
    router_logits, then route_align."""
    tokens, num_experts = len(x), w.shape[0]
    normed = torch.empty_like(x) if norm_eps is not None else None
    if ticket is None or tokens != 1 or triton.next_power_of_2(num_experts) > ONE_EXPERTS:
        logits = router_logits(x, w, pdl, norm_eps=norm_eps, normed=normed)
        routed = route_align(logits, k, renormalize, block_m, pdl=pdl)
    else:
        routed = _routed(1, k, aligned_rows(k, num_experts, block_m), block_m, x.device)
        logits = torch.empty(1, num_experts, dtype=torch.float64, device=x.device)
        _launch_router(x, w, logits, normed, norm_eps,
                       (ticket, *routed, k, renormalize, block_m), pdl)
    return (x if normed is None else normed), routed
