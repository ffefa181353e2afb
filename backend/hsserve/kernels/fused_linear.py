"""The MLP's first half for a decode batch of 1-4 rows (CUDA): residual add + RMSNorm + the fused
[gate; up] product + SiLU-and-mul in one weight-streaming kernel, instead of a norm kernel, a
cuBLAS GEMV and a SiLU-mul kernel.

Each program streams BLOCK_N matching gate and up weight rows over all of K and multiplies them
with the rows on the CUDA cores (at 1-4 rows a product is a pass over the weight). The norm is
applied after the product, y = rstd * ((x * g) W^T), its sum of squares accumulated in the same
pass over K; program 0 also stores x + residual (the next residual).

Measured on the H200 for the Llama-3.2-1B MLP at one row (bench/gpu_linear.py): 22.8 us against
24.2 us for the three kernels it replaces. The same kernel shape lost to cuBLAS on the smaller
q/k/v, o_proj and down products (results/h200_linear_sweep.json, commit ebcc7ac): too few
programs stream too few bytes each to fill the memory system, so those stay on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.elementwise import add_rmsnorm_ref, silu_mul_ref

MAX_ROWS = 4  # NOTE: above this the MLP runs as norm kernel + cuBLAS + SiLU-mul kernel
CONFIG = dict(BLOCK_N=8, BLOCK_K=512, num_warps=2, num_stages=2)  # NOTE: best of the H200 sweep


@triton.jit
def _norm_gate_up_silu_kernel(
    X, R, RES_OUT, G, W, Y,
    M, N, K, eps,
    stride_xm, stride_rm, stride_om, stride_wn, stride_ym,
    HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; the up rows are N further
    n_ok = rows < N
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0)
        if HAS_RES:
            x = x + tl.load(R + m[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0)
            if pid == 0:
                tl.store(RES_OUT + m[:, None] * stride_om + ks[None, :], x, mask=xm)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, 1)
        xf = xf * tl.load(G + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        xw = xf.to(W.dtype.element_ty).to(tl.float32)[:, None, :]
        wm = n_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(W + rows[:, None] * stride_wn + ks[None, :], mask=wm, other=0.0)
        w_up = tl.load(W + (rows + N)[:, None] * stride_wn + ks[None, :], mask=wm, other=0.0)
        gate += tl.sum(xw * w_gate.to(tl.float32)[None, :, :], axis=2)
        up += tl.sum(xw * w_up.to(tl.float32)[None, :, :], axis=2)
    rstd = tl.rsqrt(ss / K + eps)[:, None]
    gate = gate * rstd
    y = gate / (1.0 + tl.exp(-gate)) * (up * rstd)
    tl.store(Y + m[:, None] * stride_ym + rows[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def norm_gate_up_silu(x, residual, g, eps, weight, config=None):
    """(silu(gate) * up of RMSNorm(x + residual) [gate; up]^T, x + residual) for x [rows <= 4,
    K]; residual None: no add (the sum is x)."""
    m, k = x.shape
    assert m <= MAX_ROWS, f"{m} rows: this kernel is for 1-{MAX_ROWS}"
    n = weight.shape[0] // 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = torch.empty_like(x) if residual is not None else x
    r = residual if residual is not None else x
    cfg = dict(config or CONFIG)
    if m:
        _norm_gate_up_silu_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x, r, total, g, weight, y, m, n, k, eps,
            x.stride(0), r.stride(0), total.stride(0), weight.stride(0), y.stride(0),
            HAS_RES=residual is not None, BLOCK_M=triton.next_power_of_2(m), **cfg,
        )
    return y, total


def norm_gate_up_silu_ref(x, residual, g, eps, weight):
    """The torch composition the kernel replaces (and the test oracle)."""
    normed, total = add_rmsnorm_ref(x, residual, g, eps)
    return silu_mul_ref(torch.nn.functional.linear(normed, weight)), total
