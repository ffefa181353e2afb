"""The experts of a mixture-of-experts layer: a grouped GEMM in Triton on CUDA, the torch
reference elsewhere (and as the kernel's oracle).

Each (token, chosen expert) pair is one row. On the device, the pairs are grouped by expert into
blocks of BLOCK_M rows (align_pairs: sorted by expert, each expert's group padded to a block),
all with torch ops of fixed shapes (no host sync: capturable in the decode graphs). Then two
launches of one kernel: gate_up with SiLU-and-mul (h [pairs, I]), and down scaled by the pair's
routing weight (y [pairs, H]); then the k pairs of a token are summed (sum_pairs). A block reads
only its expert's weights, so a decode step reads each chosen expert once (at batch 1, only the
chosen ones). The launch (tile, warps, stages) is gemm_config's, by size; bench/moe_kernels.py
sweeps it. At one token the launches chain by programmatic dependent launch (kernels/pdl.py),
and one_token_experts has gate_up's programs route the token from the router's logits
(moe_route.py route_slot): block j is slot j's expert, and no routing launch runs before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hsserve.kernels.moe_route import aligned_rows, route_slot, routed_buffers
from hsserve.kernels.pdl import pdl_enter


def experts_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, experts: torch.Tensor, weigh_in_float: bool) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights / experts [T, k] -> [T, H]: each
    expert some token chose runs once over its tokens (its host loop is why the CPU path is not
    capturable)."""
    if not weigh_in_float:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int):
    """-> (pair ids grouped by expert, each group padded to block_m with the id `pairs`; the
    expert of each block, num_experts past the last used one). Sizes depend on the shapes only."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.sort(flat, stable=True).indices
    grouped = flat[order]
    first = counts.cumsum(0) - counts  # NOTE: each expert's first index in `order`
    dest = ends[grouped] - padded[grouped] + torch.arange(pairs, device=flat.device) - first[grouped]
    rows = aligned_rows(pairs, num_experts, block_m)
    ids = torch.full((rows,), pairs, dtype=torch.int64, device=flat.device)
    ids[dest] = order
    starts = torch.arange(0, rows, block_m, device=flat.device)
    return ids, torch.searchsorted(ends, starts, right=True)


@triton.jit
def _grouped_gemm_kernel(X, W, OUT, IDS, BLOCK_EXPERT, WEIGHTS, LOGITS, EXPERTS, pairs,
                         num_experts, N, K, stride_x, stride_we, stride_wn, stride_out,
                         ROW_DIV: tl.constexpr, SILU_MUL: tl.constexpr, WEIGH: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr, ROUTE_K: tl.constexpr, RENORM: tl.constexpr,
                         E_PAD: tl.constexpr):
    """OUT[pair] = f(X[pair // ROW_DIV] @ W[e]^T) over one block of pairs x BLOCK_N columns;
    SILU_MUL: W holds gate rows then up rows (N each), f = silu(gate) * up; WEIGH: x the pair's
    routing weight. ROUTE_K > 0 (one token, gate_up): each program routes the token from LOGITS
    (moe_route.py route_slot): block j is slot j."""
    pdl_enter(PDL)  # NOTE: which weights to read is the routing's: nothing to load before
    if ROUTE_K > 0:
        e, ids = route_slot(LOGITS, WEIGHTS, EXPERTS, IDS, BLOCK_EXPERT, num_experts, ROUTE_K,
                            RENORM, E_PAD, BLOCK_M)
    else:
        e = tl.load(BLOCK_EXPERT + tl.program_id(0))
        ids = tl.load(IDS + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    if e < num_experts:
        valid = ids < pairs
        rows = tl.where(valid, ids, 0) // ROW_DIV
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w = W + e.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(X + rows[:, None] * stride_x + ks[None, :],
                        mask=valid[:, None] & (ks[None, :] < K), other=0.0)
            wmask = (ks[:, None] < K) & (cols[None, :] < N)
            b = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=wmask, other=0.0)
            acc += tl.dot(a, b, input_precision="ieee")  # NOTE: no TF32 for float32 models
            if SILU_MUL:
                b2 = tl.load(w + (cols[None, :] + N) * stride_wn + ks[:, None], mask=wmask,
                             other=0.0)
                acc2 += tl.dot(a, b2, input_precision="ieee")
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        if WEIGH:
            acc = acc * tl.load(WEIGHTS + tl.where(valid, ids, 0), mask=valid, other=0.0)[:, None]
        out = OUT + ids[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


class GemmConfig(NamedTuple):
    """The grouped GEMM's launch: columns and depth of a program's tile, warps, pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DECODE_PAIRS = 128  # NOTE: up to here the decode configs (a few rows per expert block)
ONE_TOKEN_PAIRS = 16  # NOTE: up to here batch 1's (one block per chosen expert)
ONE_TOKEN_GATE_UP = (32, 128, 2, 4)  # NOTE: GemmConfig fields; read at launch (graph_flags_ab)
ONE_TOKEN_DOWN = (64, 128, 4, 5)


def gemm_config(pairs: int, silu_mul: bool) -> GemmConfig:
    """The launch of one grouped GEMM over `pairs` rows, gate_up's (silu_mul) or down's: the
    fastest of bench/moe_kernels.py's sweeps (Qwen3-30B-A3B). At batch 1 gate_up takes narrow
    tiles (more programs over its 8 x 12 column tiles of 64) and down one more stage; above, 64
    columns by 128 deep, 4 warps for both; at decode sizes a block holds a row or two and reading
    the weights is the cost: one more pipeline stage keeps loads in flight."""
    if pairs <= ONE_TOKEN_PAIRS:
        return GemmConfig(*(ONE_TOKEN_GATE_UP if silu_mul else ONE_TOKEN_DOWN))
    return GemmConfig(64, 128, 4, 4 if pairs <= DECODE_PAIRS else 3)


def _grouped_gemm(x, w, ids, block_expert, pairs, n, row_div, silu_mul, weights, block_m,
                  config: GemmConfig | None, pdl: bool = False, route=None):
    """route: (logits, experts, k, renormalize): one token's routing in gate_up's programs,
    written into weights, experts, ids and block_expert."""
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    cfg = config or gemm_config(pairs, silu_mul)
    grid = (len(block_expert), triton.cdiv(n, cfg.block_n))
    logits, experts, route_k, renorm = route or (out, out, 0, False)
    _grouped_gemm_kernel[grid](
        x, w, out, ids, block_expert, weights if weights is not None else out, logits, experts,
        pairs, w.shape[0], n, x.shape[1], x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROW_DIV=row_div, SILU_MUL=silu_mul, WEIGH=weights is not None and route is None,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl, ROUTE_K=route_k,
        RENORM=bool(renorm), E_PAD=triton.next_power_of_2(w.shape[0]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    return out


@triton.jit
def _sum_pairs_kernel(Y, OUT, H, K: tl.constexpr, BLOCK_H: tl.constexpr, INTO: tl.constexpr,
                      PDL: tl.constexpr):
    """OUT[t] = Y[t K] + ... + Y[t K + K - 1] in float32, in that order, cast once; INTO: that
    sum added to OUT[t] (cast again: the add of a layer's output to the residual stream)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(Y + (t * K + j) * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = acc.to(OUT.dtype.element_ty)
    if INTO:
        y = (tl.load(OUT + t * H + cols, mask=cols < H, other=0.0).to(tl.float32)
             + y.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + t * H + cols, y, mask=cols < H)


SUM_CONFIG = (256, 1)  # NOTE: (BLOCK_H, num_warps): a warp's 16-byte loads of bf16 (others: noise)


def sum_pairs(y: torch.Tensor, k: int, config: tuple[int, int] | None = None,
              pdl: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
    """y [tokens * k, H] (each token's k pairs in a row) -> [tokens, H]: the pairs' sum in a
    fixed order (deterministic); added to `into` in place and returned when given (as
    into.add_(sum)). config: (BLOCK_H, num_warps), SUM_CONFIG by default."""
    pairs, hidden = y.shape
    assert y.is_contiguous() and pairs % k == 0
    out = into if into is not None else torch.empty(pairs // k, hidden, dtype=y.dtype,
                                                    device=y.device)
    assert out.is_contiguous() and out.shape == (pairs // k, hidden)
    block_h, warps = config or SUM_CONFIG
    _sum_pairs_kernel[(pairs // k, triton.cdiv(hidden, block_h))](
        y, out, hidden, K=k, BLOCK_H=block_h, INTO=into is not None, PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    return out


def block_rows(pairs: int) -> int:
    """BLOCK_M of the grouped GEMM: small groups at decode sizes, larger for prefill."""
    return 16 if pairs <= 1024 else 64


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, experts: torch.Tensor, weigh_in_float: bool,
                  aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
                  configs: tuple[GemmConfig | None, GemmConfig | None] = (None, None),
                  pdl: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
    """experts_ref's result through the grouped GEMM (routing weights applied in float32 either
    way: the kernel's accumulator is float32). aligned: align_pairs' result for block_rows,
    when already made (kernels/moe_route.py); configs: gate_up's and down's launches (None:
    gemm_config's); pdl: the launches chained (kernels/pdl.py's pdl_on of x); into: the result
    added to it in place (sum_pairs')."""
    tokens, k = experts.shape
    block_m = block_rows(tokens * k)
    ids, block_expert = aligned or align_pairs(experts, gate_up.shape[0], block_m)
    inter = down.shape[2]
    pairs = tokens * k
    h = _grouped_gemm(x.contiguous(), gate_up, ids, block_expert, pairs, inter, k, True, None,
                      block_m, configs[0], pdl)
    y = _grouped_gemm(h, down, ids, block_expert, pairs, down.shape[1], 1, False,
                      weights.float().reshape(-1).contiguous(), block_m, configs[1], pdl)
    return sum_pairs(y, k, pdl=pdl, into=into)


def one_token_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, k: int, renormalize: bool, pdl: bool = False,
                      into: torch.Tensor | None = None) -> torch.Tensor:
    """fused_experts for one token routed inside gate_up's programs from its float64 router
    logits [1, E] (no routing launch): gate_up's block j is slot j's expert."""
    assert len(x) == 1 and logits.shape == (1, gate_up.shape[0]) and k <= gate_up.shape[0]
    block_m = block_rows(k)
    weights, experts, ids, block_expert = routed_buffers(1, k, k * block_m, block_m, x.device)
    h = _grouped_gemm(x.contiguous(), gate_up, ids, block_expert, k, down.shape[2], k, True,
                      weights, block_m, None, pdl, (logits, experts, k, renormalize))
    y = _grouped_gemm(h, down, ids, block_expert, k, down.shape[1], 1, False, weights, block_m,
                      None, pdl)
    return sum_pairs(y, k, pdl=pdl, into=into)
