"""One token's mixture-of-experts layer in one launch (a decode step at batch 1 on CUDA): the
router's float64 logits and the routing (kernels/moe_route.py's pieces), then gate_up and down as
matrix-vector products, the down product's weights loaded while gate_up still runs, and the k
pairs summed (and added into the residual stream) inside it. Its references: MoE.route and
experts_ref (kernels/moe.py); the grouped GEMM's path is the one for more tokens.

At one token the k chosen experts are distinct: nothing to group. Two launches (gate_up, then
down) each drain the memory system at their end and ramp it up at their start, and down cannot
load its weights before gate_up is done: a kernel boundary is a wait for the whole previous
grid. Here a launch holds them all: each program takes a ticket on arrival; the first tickets
are the router's items (router_store over a few of its rows; the last to finish routes the token,
route_one, and raises a flag the others wait for), then gate_up's items (a few rows of one slot's gate and up: h = silu(gate) * up, written to a
scratch row), the rest down's (a few output rows over all k slots). A down program loads its
rows of the k experts' down weights, then waits until every gate_up item has counted itself done,
then reads h. Tickets go in order of arrival, so a waiting program never holds back an item it
waits for (no deadlock whatever the hardware's order of programs). The last down program to
finish zeroes the counters for the next launch.

Sums: each pair's product x its routing weight (float32) is rounded to the model's dtype, as the
grouped GEMM stores it, then the k pairs are summed in float32 in slot order, cast once
(sum_pairs' order), and added to the stream as into.add_(sum) would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.moe_route import (ONE_EXPERTS, ROUTER_EXPERTS, route_one, router_rows,
                                       router_store)
from hsserve.kernels.pdl import pdl_enter

_W_POLICY = "evict_first"  # NOTE: weights stream through L2 once a step (kernels/gemv.py)
_SLAB_BYTES = 32 << 10  # NOTE: weight bytes a program holds at most (as the GEMV's slabs)
# NOTE: (rows of gate and of up a gate_up item takes, output rows a down item takes over all k
# slots, warps a program): ~32 KB of weights each, as the GEMV's slabs
ONE_CONFIG = (4, 2, 4)
_COUNTERS = 5


def counters(device: torch.device) -> torch.Tensor:
    """The launch's counters (tickets, gate_up items done, down items done, router items done,
    routed): zero, and zero again after each launch."""
    return torch.zeros(_COUNTERS, dtype=torch.int32, device=device)


def one_token_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int) -> bool:
    """One row, weights of x's dtype, contiguous, and one row's slab within _SLAB_BYTES: gate and
    up (2 x hidden), down's k slots (k x inter, padded to powers of two)."""
    size = x.element_size()
    return (x.dim() == 2 and len(x) == 1 and x.stride(1) == 1 and gate_up.is_contiguous()
            and down.is_contiguous() and gate_up.dtype == down.dtype == x.dtype
            and 2 * triton.next_power_of_2(gate_up.shape[2]) * size <= _SLAB_BYTES
            and triton.next_power_of_2(k) * triton.next_power_of_2(down.shape[2]) * size
            <= _SLAB_BYTES)


def _rows(n: int, want: int, row_bytes: int) -> int:
    """A power of two <= want, within _SLAB_BYTES of weights, dividing n."""
    rows = want
    while rows > 1 and (n % rows or rows * row_bytes > _SLAB_BYTES):
        rows //= 2
    return rows


@triton.jit
def _gate_up_item(X, GU, H, EXPERTS, item, K, inter, stride_ge, GATE_ROWS: tl.constexpr,
                  KP: tl.constexpr, W_POLICY: tl.constexpr):
    tiles = inter // GATE_ROWS
    slot = item // tiles
    rn = (item % tiles) * GATE_ROWS + tl.arange(0, GATE_ROWS)
    rk = tl.arange(0, KP)
    kmask = rk < K
    # NOTE: from L2 (.cg): the routing and the normed row may be this launch's
    e = tl.load(EXPERTS + slot, cache_modifier=".cg").to(tl.int64)
    gate = GU + e * stride_ge + rn[:, None].to(tl.int64) * K + rk[None, :]
    wg = tl.load(gate, mask=kmask[None, :], other=0.0, eviction_policy=W_POLICY)
    wu = tl.load(gate + inter * K, mask=kmask[None, :], other=0.0, eviction_policy=W_POLICY)
    x = tl.load(X + rk, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    g = tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
    u = tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    tl.store(H + slot * inter + rn, (g / (1.0 + tl.exp(-g)) * u).to(H.dtype.element_ty))


@triton.jit
def _wait_for(COUNTER, target):
    """Spin until COUNTER reaches target (acquire: what was written before it is seen)."""
    done = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
    while done < target:
        done = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _down_item(H, DOWN, OUT, EXPERTS, WEIGHTS, COUNT, item, gate_items, inter, stride_de,
               TOPK: tl.constexpr, SP: tl.constexpr, DOWN_ROWS: tl.constexpr, IP: tl.constexpr,
               INTO: tl.constexpr, W_POLICY: tl.constexpr):
    rn = item * DOWN_ROWS + tl.arange(0, DOWN_ROWS)
    ri = tl.arange(0, IP)
    s = tl.arange(0, SP)  # NOTE: slots padded to a power of two; the padding reads nothing
    e = tl.load(EXPERTS + s, mask=s < TOPK, other=0, cache_modifier=".cg").to(tl.int64)
    mask = (s < TOPK)[:, None] & (ri < inter)[None, :]
    w = tl.load(DOWN + e[:, None, None] * stride_de + rn[None, :, None].to(tl.int64) * inter
                + ri[None, None, :], mask=mask[:, None, :], other=0.0, eviction_policy=W_POLICY)
    _wait_for(COUNT + 1, gate_items)  # NOTE: the weights are in flight; h is gate_up's
    h = tl.load(H + s[:, None] * inter + ri[None, :], mask=mask, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    prod = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)  # NOTE: [SP, DOWN_ROWS]
    weight = tl.load(WEIGHTS + s, mask=s < TOPK, other=0.0, cache_modifier=".cg")
    pairs = (prod * weight[:, None]).to(OUT.dtype.element_ty).to(tl.float32)
    acc = tl.zeros((DOWN_ROWS,), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # NOTE: slot order, as sum_pairs
        acc += tl.sum(tl.where(s[:, None] == j, pairs, 0.0), axis=0)
    y = acc.to(OUT.dtype.element_ty)
    if INTO:
        y = (tl.load(OUT + rn).to(tl.float32) + y.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + rn, y)


@triton.jit
def _router_item(X, ROUTER, LOGITS, XN, EXPERTS, WEIGHTS, COUNT, item, router_items,
                 num_experts, K, stride_re, eps, TOPK: tl.constexpr, RENORM: tl.constexpr,
                 E_PAD: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr,
                 NORM: tl.constexpr, PDL: tl.constexpr):
    e = item * BLOCK_E + tl.arange(0, BLOCK_E)
    w = router_rows(ROUTER, e, num_experts, K, stride_re, KP)
    pdl_enter(PDL)  # NOTE: the stream is the kernel before's; the router's rows are not
    router_store(X, w, LOGITS, XN, 0, e, num_experts, K, 0, eps, item == 0, KP, NORM)
    tl.debug_barrier()  # NOTE: every thread's logits (and normed row) stored before the count
    if tl.atomic_add(COUNT + 3, 1, sem="acq_rel", scope="gpu") == router_items - 1:
        route_one(LOGITS, WEIGHTS, EXPERTS, LOGITS, LOGITS, num_experts, 0, TOPK, RENORM, E_PAD,
                  1, 1, False)
        tl.debug_barrier()
        tl.atomic_add(COUNT + 4, 1, sem="release", scope="gpu")  # NOTE: routed


@triton.jit
def _one_token_kernel(X, ROUTER, GU, DOWN, XN, LOGITS, H, OUT, EXPERTS, WEIGHTS, COUNT, K, inter,
                      num_experts, eps, router_items, gate_items, down_items, stride_re,
                      stride_ge, stride_de, TOPK: tl.constexpr, SP: tl.constexpr,
                      RENORM: tl.constexpr, E_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                      ROUTE: tl.constexpr, NORM: tl.constexpr, GATE_ROWS: tl.constexpr,
                      DOWN_ROWS: tl.constexpr, KP: tl.constexpr, IP: tl.constexpr,
                      INTO: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr,
                      NUM_COUNTERS: tl.constexpr):
    # NOTE: the ticket before the wait: the counters were zeroed by this launch's last run
    item = tl.atomic_add(COUNT, 1, sem="relaxed", scope="gpu")
    if item < router_items:  # NOTE: none without ROUTE
        if ROUTE:
            _router_item(X, ROUTER, LOGITS, XN, EXPERTS, WEIGHTS, COUNT, item, router_items,
                         num_experts, K, stride_re, eps, TOPK, RENORM, E_PAD, BLOCK_E, KP, NORM,
                         PDL)
    else:
        pdl_enter(PDL)  # NOTE: every weight to read is the routing's choice: nothing before
        if ROUTE:
            _wait_for(COUNT + 4, 1)
        item -= router_items
        if item < gate_items:
            _gate_up_item(XN, GU, H, EXPERTS, item, K, inter, stride_ge, GATE_ROWS, KP, W_POLICY)
            tl.debug_barrier()  # NOTE: every thread's h stored before the count
            tl.atomic_add(COUNT + 1, 1, sem="release", scope="gpu")
        else:
            _down_item(H, DOWN, OUT, EXPERTS, WEIGHTS, COUNT, item - gate_items, gate_items,
                       inter, stride_de, TOPK, SP, DOWN_ROWS, IP, INTO, W_POLICY)
            tl.debug_barrier()
            if tl.atomic_add(COUNT + 2, 1, sem="acq_rel", scope="gpu") == down_items - 1:
                c = tl.arange(0, 8)  # NOTE: all items done: zero for the next launch
                tl.store(COUNT + c, tl.zeros((8,), dtype=tl.int32), mask=c < NUM_COUNTERS)


def one_token_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, k: int, renormalize: bool, count: torch.Tensor,
                  norm_eps: float | None = None, into: torch.Tensor | None = None,
                  pdl: bool = False, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """A MoE layer for one token x [1, H]: the router's rows [E, H] (MoE.route's routing of its
    float64 logits: top k, renormalized or not), gate_up [E, 2I, H], down [E, H, I] -> [1, H] in
    x's dtype (added into `into` in place and returned when given); norm_eps: x is the residual
    stream, RMS-normed first (no weight: it is in router and gate_up). count: counters();
    config: (gate rows, down rows, warps) (ONE_CONFIG)."""
    num_experts = router.shape[0]
    assert router.shape[1] == x.shape[1] and router.stride(1) == 1 and k <= num_experts
    assert triton.next_power_of_2(num_experts) <= ONE_EXPERTS
    logits = torch.empty(num_experts, dtype=torch.float64, device=x.device)
    weights = torch.empty(k, dtype=torch.float32, device=x.device)
    experts = torch.empty(k, dtype=torch.int64, device=x.device)
    normed = torch.empty_like(x) if norm_eps is not None else x
    route = (router, logits, normed, norm_eps)
    return _launch(x, gate_up, down, weights, experts, count, into, pdl, config, route,
                   renormalize)


def one_token_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      weights: torch.Tensor, experts: torch.Tensor, count: torch.Tensor,
                      into: torch.Tensor | None = None, pdl: bool = False,
                      config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The experts alone for a given routing: weights [1, k] float32, experts [1, k] (distinct);
    otherwise as one_token_moe (x: the normed row)."""
    assert weights.dtype == torch.float32
    return _launch(x, gate_up, down, weights.reshape(-1).contiguous(),
                   experts.reshape(-1).contiguous(), count, into, pdl, config, None, False)


def _launch(x, gate_up, down, weights, experts, count, into, pdl, config, route, renormalize):
    """route: (router rows, logits [E] float64, normed row, norm eps or None) or None (the
    routing given)."""
    k = experts.numel()
    assert one_token_fits(x, gate_up, down, k)
    assert count.dtype == torch.int32 and count.numel() >= _COUNTERS
    _, two_inter, hidden = gate_up.shape
    inter, size = two_inter // 2, x.element_size()
    kp, ip, sp = (triton.next_power_of_2(n) for n in (hidden, inter, k))
    gate_rows, down_rows, warps = config or ONE_CONFIG
    gate_rows = _rows(inter, gate_rows, 2 * kp * size)
    down_rows = _rows(hidden, down_rows, sp * ip * size)
    gate_items, down_items = k * inter // gate_rows, hidden // down_rows
    h = torch.empty(k, inter, dtype=x.dtype, device=x.device)
    out = into if into is not None else torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    assert out.is_contiguous() and out.shape == (1, hidden)
    router, logits, normed, eps = route or (x, weights, x, None)
    num_experts = router.shape[0] if route else 1
    router_items = triton.cdiv(num_experts, ROUTER_EXPERTS) if route else 0
    _one_token_kernel[(router_items + gate_items + down_items,)](
        x, router, gate_up, down, normed, logits, h, out, experts, weights, count, hidden, inter,
        num_experts, eps or 0.0, router_items, gate_items, down_items, router.stride(0),
        gate_up.stride(0), down.stride(0), TOPK=k, SP=sp, RENORM=bool(renormalize),
        E_PAD=triton.next_power_of_2(num_experts), BLOCK_E=ROUTER_EXPERTS, ROUTE=route is not None,
        NORM=eps is not None, GATE_ROWS=gate_rows, DOWN_ROWS=down_rows, KP=kp, IP=ip,
        INTO=into is not None, PDL=pdl, W_POLICY=_W_POLICY, NUM_COUNTERS=_COUNTERS, num_warps=warps, launch_pdl=pdl)
    return out
