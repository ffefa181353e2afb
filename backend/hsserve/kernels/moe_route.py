"""A decode step's expert routing on CUDA, for the grouped GEMM of kernels/moe.py: the router's
float64 logits (router_logits; its reference: F.linear in float64), then the routing and the
pairs' alignment by expert in one program (route_align; its reference: MoE.route, then
align_pairs). At one token the routing runs inside gate_up's programs instead (route_slot).

At decode sizes the routing's softmax / top-k / renormalization and align_pairs' ~25 small torch
ops cost more in launches than the experts' weights take to read
(bench/README.md#mixture-of-experts-h200). route_align takes the logits [T, E] and writes each
token's k experts and float32 weights, the pair ids grouped by expert (padding id T * k) and each
block's expert, for up to a decode graph's tokens (routes_in_kernel). route_slot routes one
token in every program of gate_up's launch (kernels/moe.py one_token_experts): no routing
launch and no wait on one. Both choose by the same keys (_keys), so a tie goes the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.pdl import pdl_enter

# NOTE: route_align holds a step's logits [tokens, experts] in one program: 64 tokens of
# Qwen3-30B-A3B (128 experts, k = 8), the largest decode graph's
MAX_PAIRS = 512
MAX_LOGITS = 8192
ROUTE_WARPS = 4  # NOTE: the fastest up to 16 tokens (bench/moe_kernels.py): 1 or 2 are slower
# NOTE: router rows a program (bench/README.md#mixture-of-experts-h200); it shapes the float64
# sums: the same for every batch, so fixed, not chosen by size
ROUTER_EXPERTS = 4


def routes_in_kernel(tokens: int, k: int, num_experts: int) -> bool:
    """Whether route_align takes this many tokens (MAX_PAIRS, MAX_LOGITS: read at each call)."""
    return tokens * k <= MAX_PAIRS and tokens * num_experts <= MAX_LOGITS


def aligned_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the grouped ids at most: the pairs, each used expert's group padded to block_m."""
    return -(-(pairs + min(pairs, num_experts) * (block_m - 1)) // block_m) * block_m


@triton.jit
def _router_kernel(X, W, OUT, XN, num_experts, K, stride_x, stride_w, eps,
                   BLOCK_E: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                   PDL: tl.constexpr):
    """OUT[t, e] = sum_k X[t, k] W[e, k] in float64, for one token and BLOCK_E experts. NORM: X is
    the residual stream, RMS-normed here (no weight: it is in W) and written to XN."""
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


def router_logits(x: torch.Tensor, w: torch.Tensor, pdl: bool = False,
                  block_e: int | None = None, norm_eps: float | None = None,
                  normed: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] and the router's rows w [E, H] (float dtypes of the model) -> float64 logits
    [T, E], as F.linear(x.double(), w.double()) to float64 rounding. norm_eps: x is the residual
    stream, RMS-normed (no weight) into `normed` (x's shape and dtype) and the logits of that."""
    tokens, hidden = x.shape
    num_experts = w.shape[0]
    assert w.shape[1] == hidden and x.stride(1) == 1 and w.stride(1) == 1
    assert normed is None or normed.stride() == x.stride()
    out = torch.empty(tokens, num_experts, dtype=torch.float64, device=x.device)
    block_e = block_e or ROUTER_EXPERTS
    kp = triton.next_power_of_2(hidden)
    warps = min(16, max(1, block_e * kp // 1024))  # NOTE: ~32 float64 products a thread
    _router_kernel[(tokens, triton.cdiv(num_experts, block_e))](
        x, w, out, normed if normed is not None else x, num_experts, hidden, x.stride(0),
        w.stride(0), norm_eps or 0.0, BLOCK_E=block_e, KP=kp, NORM=norm_eps is not None,
        PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out


@triton.jit
def _keys(probs, e, real, E_PAD: tl.constexpr):
    """Each expert's sort key: its probability's bits (>= 0: ordered as the floats) over its
    index reversed, so the largest key is the largest probability, the lowest index on a tie;
    -1 where not real (never chosen)."""
    return tl.where(real, (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - e),
                    -1)


@triton.jit
def _unkey(best, E_PAD: tl.constexpr):
    """A key (_keys) -> (its expert, its probability)."""
    hi = best >> 32
    return (E_PAD - 1 - (best - (hi << 32))).to(tl.int32), hi.to(tl.int32).to(tl.float32,
                                                                               bitcast=True)


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
        idx, prob = _unkey(tl.max(key, 1), E_PAD)
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
    p = tl.arange(0, P_PAD)
    valid = chosen >= 0
    counts = tl.histogram(tl.where(valid, chosen, 0), E_PAD, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    # NOTE: sorted by (expert, pair id), padding last: an expert's pairs together in pair order,
    # the i-th of them going to its group's start + i
    key = tl.sort(tl.where(valid, chosen * P_PAD + pair, E_PAD * P_PAD + p))
    expert = key // P_PAD
    placed = expert < E_PAD
    shift = ends - padded - (tl.cumsum(counts, 0) - counts)  # NOTE: group start - first place
    dest = p + tl.gather(shift, tl.where(placed, expert, 0), 0)
    r = tl.arange(0, R_PAD)
    tl.store(IDS + r, tl.zeros((R_PAD,), dtype=tl.int64) + pairs, mask=r < rows)
    tl.debug_barrier()  # NOTE: the padding ids first, then the pairs over them
    tl.store(IDS + dest, (key % P_PAD).to(tl.int64), mask=placed)
    # NOTE: block b's expert = the experts whose group ends at or before it (empty ones too)
    last = ends // BLOCK_M
    counted = (tl.arange(0, E_PAD) < num_experts) & (last < B_PAD)
    before = tl.cumsum(tl.histogram(tl.where(counted, last, 0), B_PAD, mask=counted), 0)
    b = tl.arange(0, B_PAD)
    tl.store(BLOCK_EXPERT + b, before.to(tl.int64), mask=b < num_blocks)


def _pads(tokens: int, k: int) -> tuple[int, int]:
    """(T_PAD, K_PAD): powers of two, at least 16 pairs and 2 slots."""
    k_pad = max(2, triton.next_power_of_2(k))
    return max(triton.next_power_of_2(tokens), triton.cdiv(16, k_pad)), k_pad


def route_warps(tokens: int, k: int, num_experts: int) -> int:
    """route_align's warps: ROUTE_WARPS, more for a larger step (~16 logits a thread at most;
    ROUTE_WARPS up to 16 tokens of 128 experts, 16 at 64)."""
    t_pad = _pads(tokens, k)[0]
    return max(ROUTE_WARPS, min(16, t_pad * triton.next_power_of_2(num_experts) // 512))


def route_align(logits: torch.Tensor, k: int, renormalize: bool, block_m: int,
                num_warps: int | None = None, pdl: bool = False):
    """float64 router logits [T, E] -> (weights [T, k] float32, experts [T, k], pair ids grouped
    by expert, each block's expert): MoE.route and align_pairs in one launch. num_warps: None
    for route_warps'."""
    tokens, num_experts = logits.shape
    pairs = tokens * k
    assert routes_in_kernel(tokens, k, num_experts), "route_align is for decode sizes"
    rows = aligned_rows(pairs, num_experts, block_m)
    weights, experts, ids, block_expert = routed_buffers(tokens, k, rows, block_m, logits.device)
    t_pad, k_pad = _pads(tokens, k)
    _route_align_kernel[(1,)](
        logits.contiguous(), weights, experts, ids, block_expert, tokens, num_experts, rows,
        rows // block_m, K=k, RENORM=renormalize, E_PAD=triton.next_power_of_2(num_experts),
        T_PAD=t_pad, K_PAD=k_pad, R_PAD=triton.next_power_of_2(rows),
        B_PAD=max(16, triton.next_power_of_2(rows // block_m)), BLOCK_M=block_m, PDL=pdl,
        num_warps=num_warps or route_warps(tokens, k, num_experts), launch_pdl=pdl)
    return weights, experts, ids, block_expert


def routed_buffers(tokens: int, k: int, rows: int, block_m: int, dev: torch.device):
    """Room for the routing: (weights, experts, pair ids, each block's expert)."""
    return (torch.empty(tokens, k, dtype=torch.float32, device=dev),
            torch.empty(tokens, k, dtype=torch.int64, device=dev),
            torch.empty(rows, dtype=torch.int64, device=dev),
            torch.empty(rows // block_m, dtype=torch.int64, device=dev))


def decode_route(x: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool, block_m: int,
                 pdl: bool = False, norm_eps: float | None = None):
    """A decode step's routing of the rows x [T, H] -> (the rows the experts read, route_align's
    four tensors): router_logits, then route_align. norm_eps: x is the residual stream, RMS-normed
    by the router (the norm's weight is in w and the experts')."""
    rows, logits = normed_logits(x, w, pdl, norm_eps)
    return rows, route_align(logits, k, renormalize, block_m, pdl=pdl)


def normed_logits(x: torch.Tensor, w: torch.Tensor, pdl: bool = False,
                  norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (the rows the experts read, router_logits'): with norm_eps x is the residual stream,
    RMS-normed by the router kernel into the rows it returns; else x itself."""
    normed = torch.empty_like(x) if norm_eps is not None else None
    logits = router_logits(x, w, pdl, norm_eps=norm_eps, normed=normed)
    return (x if normed is None else normed), logits


@triton.jit
def route_slot(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, K: tl.constexpr,
               RENORM: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """One token's routing from its float64 logits, in a program of a (slot, column tile) grid:
    _route_align_kernel's for one row (the same keys, k rounds of their maximum, the weights'
    float32 sum in slot order) -> (the expert of this program's slot j, its block's pair ids: j,
    then padding k). Block j is slot j. The first column tile writes the slot's weight, expert,
    ids and block expert (for down)."""
    j = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    real = e < num_experts
    lg = tl.load(LOGITS + e, mask=real, other=float("-inf"))
    ex = tl.exp(lg - tl.max(lg, 0))
    key = _keys((ex / tl.sum(ex, 0)).to(tl.float32), e, real, E_PAD)
    mine = j * 0
    weight = 0.0
    total = 0.0
    for s in tl.static_range(K):
        idx, prob = _unkey(tl.max(key, 0), E_PAD)
        mine = tl.where(j == s, idx, mine)
        weight = tl.where(j == s, prob, weight)
        total += prob
        key = tl.where(e == idx, -1, key)
    if RENORM:
        weight = weight / total
    r = tl.arange(0, BLOCK_M)
    ids = tl.where(r == 0, j, K).to(tl.int64)
    if tl.program_id(1) == 0:
        tl.store(WEIGHTS + j, weight)
        tl.store(EXPERTS + j, mine.to(tl.int64))
        tl.store(IDS + j * BLOCK_M + r, ids)
        tl.store(BLOCK_EXPERT + j, mine.to(tl.int64))
    return mine.to(tl.int64), ids
