"""One token's experts as matrix-vector products (a decode step at batch 1 on CUDA): the grouped
GEMM of kernels/moe.py without its blocks of 16 rows, and with the pairs' sum inside the down
product (its reference: experts_ref).

At one token the k chosen experts are distinct, so there is nothing to group: gate_up runs one
program per (slot, a few rows of the expert's gate and up), each reading its expert's rows
whole, as the dense GEMV does (kernels/gemv.py); down runs one program per few output rows, over
all k slots in slot order, weighing each product in float32 and writing the token's row once
(no [k, H] pairs, no summing launch). Which expert a slot holds is the routing's: a program waits
(PDL) before it reads anything. Weights load evict_first, streamed once a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.pdl import pdl_enter

_SLAB_BYTES = 32 << 10  # NOTE: weight bytes a program loads at once (as the GEMV's slabs)
_W_POLICY = "evict_first"


def _rows(n: int, row_bytes: int) -> int:
    """Rows a program takes: a power of two, ~_SLAB_BYTES of weights at most, dividing n."""
    rows = 1 << (max(1, _SLAB_BYTES // row_bytes).bit_length() - 1)
    while n % rows:
        rows //= 2
    return rows


def one_token_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int) -> bool:
    """Whether the decoder's MoE gives x to one_token_experts: one row on CUDA (_shapes_fit)."""
    return x.is_cuda and _shapes_fit(x, gate_up, down, k)


def _shapes_fit(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, k: int) -> bool:
    """One row, contiguous weights of x's dtype, and one program's row of gate and up (and of
    all k slots' down) within a slab."""
    size = x.element_size()
    return (x.dim() == 2 and len(x) == 1 and gate_up.is_contiguous()
            and down.is_contiguous() and gate_up.dtype == down.dtype == x.dtype
            and 2 * triton.next_power_of_2(gate_up.shape[2]) * size <= _SLAB_BYTES
            and k * triton.next_power_of_2(down.shape[2]) * size <= _SLAB_BYTES)


@triton.jit
def _gate_up_kernel(X, W, H, EXPERTS, K, inter, stride_we, BLOCK_N: tl.constexpr,
                    KP: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr):
    """H[slot, rows] = silu(x W_e[rows]^T) * (x W_e[inter + rows]^T), e the slot's expert."""
    slot = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, KP)
    kmask = rk < K
    pdl_enter(PDL)  # NOTE: the expert is the routing's: nothing to load before
    e = tl.load(EXPERTS + slot)
    gate = W + e * stride_we + rn[:, None].to(tl.int64) * K + rk[None, :]
    wg = tl.load(gate, mask=kmask[None, :], other=0.0, eviction_policy=W_POLICY)
    wu = tl.load(gate + inter * K, mask=kmask[None, :], other=0.0, eviction_policy=W_POLICY)
    x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
    g = tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
    u = tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
    tl.store(H + slot * inter + rn, (g / (1.0 + tl.exp(-g)) * u).to(H.dtype.element_ty))


@triton.jit
def _down_sum_kernel(H, W, OUT, EXPERTS, WEIGHTS, inter, stride_we, TOPK: tl.constexpr,
                     BLOCK_N: tl.constexpr, IP: tl.constexpr, PDL: tl.constexpr,
                     W_POLICY: tl.constexpr):
    """OUT[rows] = sum over slots, in order, of weight_slot * (h_slot W_e[rows]^T), in float32."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ri = tl.arange(0, IP)
    imask = ri < inter
    pdl_enter(PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        e = tl.load(EXPERTS + slot)
        w = tl.load(W + e * stride_we + rn[:, None].to(tl.int64) * inter + ri[None, :],
                    mask=imask[None, :], other=0.0, eviction_policy=W_POLICY)
        h = tl.load(H + slot * inter + ri, mask=imask, other=0.0).to(tl.float32)
        acc += tl.load(WEIGHTS + slot) * tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    tl.store(OUT + rn, acc.to(OUT.dtype.element_ty))


def _warps(rows: int, row_bytes: int) -> int:
    return 8 if rows * row_bytes > _SLAB_BYTES else 4


def one_token_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      weights: torch.Tensor, experts: torch.Tensor, pdl: bool = False
                      ) -> torch.Tensor:
    """x [1, H], gate_up [E, 2I, H], down [E, H, I], weights [1, k] float32, experts [1, k]
    (distinct) -> [1, H] in x's dtype: experts_ref's result, the routing weights applied and
    the k products summed in float32 (as one_token_fits allows)."""
    k = experts.shape[1]
    assert _shapes_fit(x, gate_up, down, k) and weights.dtype == torch.float32
    num_experts, two_inter, hidden = gate_up.shape
    inter, size = two_inter // 2, x.element_size()
    experts, weights = experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    h = torch.empty(k, inter, dtype=x.dtype, device=x.device)
    kp = triton.next_power_of_2(hidden)
    rows = _rows(inter, 2 * kp * size)
    _gate_up_kernel[(k, inter // rows)](
        x, gate_up, h, experts, hidden, inter, gate_up.stride(0), BLOCK_N=rows, KP=kp, PDL=pdl,
        W_POLICY=_W_POLICY, num_warps=_warps(rows, 2 * kp * size), launch_pdl=pdl)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    ip = triton.next_power_of_2(inter)
    rows = _rows(hidden, k * ip * size)
    _down_sum_kernel[(hidden // rows,)](
        h, down, out, experts, weights, inter, down.stride(0), TOPK=k, BLOCK_N=rows, IP=ip,
        PDL=pdl, W_POLICY=_W_POLICY, num_warps=_warps(rows, k * ip * size), launch_pdl=pdl)
    return out
