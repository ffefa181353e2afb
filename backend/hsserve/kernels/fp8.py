"""y = x (W8 * scale)^T for float8 weights (models/fp8.py) at more than one row (one row: the
GEMV kernels of kernels/gemv.py, the scales applied in their epilogue; Linear chooses).

The GEMM reads W8 tiles and widens them to x's dtype for the tensor cores (weights only), or,
where the checkpoint quantizes activations, multiplies float8 by float8 (Hopper's FP8 tensor
cores): x's rows rounded to float8 first (quantize_rows: per token, or by the static scale),
each row's scale and each weight row's applied to the float32 accumulator.

References: fp8_linear_ref (dequantize, then F.linear), quantize_rows_ref.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8_MAX = 448.0


@dataclass(frozen=True)
class Fp8Scales:
    weight: torch.Tensor  # float32 [N]: W = W8 * weight[:, None]
    quantize_inputs: bool = False  # x rounded to float8: per row, or by `input`
    input: torch.Tensor | None = None  # float32 [1]: the static input scale


def quantize_rows_ref(x: torch.Tensor, scale: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scales [M]): each row by its amax / 448, or all by
    `scale` ([1])."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=1)  # NOTE: tensor / tensor: CUDA divides a scalar by reciprocal
        s = amax / torch.full_like(amax, FP8_MAX)
        s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
    else:
        s = scale.float().expand(len(x))
    q = (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.contiguous()


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, scales: Fp8Scales,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: x (rounded to float8 where asked) against the dequantized weight."""
    if scales.quantize_inputs:
        q, s = quantize_rows_ref(x.reshape(-1, x.shape[-1]), scales.input)
        x = (q.float() * s[:, None]).to(x.dtype).view(x.shape)
    w = (w8.float() * scales.weight.float()[:, None]).to(x.dtype)
    return F.linear(x, w, bias)


@triton.jit
def _quantize_rows_kernel(X, Q, S, SCALE, K, stride_x, STATIC: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    rk = tl.arange(0, BLOCK_K)
    x = tl.load(X + row * stride_x + rk, mask=rk < K, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(SCALE)
    else:
        s = tl.div_rn(tl.max(tl.abs(x), 0), 448.0)
        s = tl.where(s == 0.0, 1.1920928955078125e-07, s)
    q = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)  # NOTE: as torch rounds
    tl.store(Q + row * K + rk, q.to(Q.dtype.element_ty), mask=rk < K)
    tl.store(S + row, s)


def quantize_rows(x: torch.Tensor, scale: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref in one kernel (a program a row)."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(m,)](x, q, s, scale if scale is not None else s, k, x.stride(0),
                                STATIC=scale is not None, BLOCK_K=block,
                                num_warps=8 if block >= 4096 else 4)
    return q, s


@triton.jit
def _fp8_gemm_kernel(X, W, Y, WS, XS, B, M, N, K, stride_x, stride_y,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     X_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, ADD: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n  # NOTE: grouped order: a group's programs share W tiles in L2
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptr = W + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = rk < K - k * BLOCK_K
        x = tl.load(x_ptr, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        w = tl.load(w_ptr, mask=(rn[None, :] < N) & kmask[:, None], other=0.0)
        if X_FP8:
            acc = tl.dot(x, w, acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K
    acc = acc * tl.load(WS + rn, mask=rn < N, other=0.0)[None, :]
    if X_FP8:
        acc = acc * tl.load(XS + rm, mask=rm < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    ymask = (rm[:, None] < M) & (rn[None, :] < N)
    if ADD:
        acc += tl.load(y_ptr, mask=ymask, other=0.0).to(tl.float32)
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=ymask)


def gemm_config(m: int, n: int, k: int, x_fp8: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by rows and shape: small tiles at decode sizes
    (more programs over the weight), large ones above (bench/README.md#fp8-gemm-configs)."""
    if x_fp8:
        return (16, 64, 256, 4, 4) if m <= 16 else (64, 64, 256, 4, 3) if m <= 64 \
            else (128, 128, 128, 8, 3)
    if m <= 16:
        return 16, 32, 256, 4, 4
    if m <= 64:
        if n >= 16384:
            return 64, 64, 64, 4, 4
        if k >= 12288 and n <= 4096:
            return 64, 32, 256, 4, 3
        return (32, 64, 128, 4, 4) if n <= 4096 else (64, 32, 128, 4, 4)
    return 128, 128, 64, 8, 3


@triton.jit
def _fp8_gemm_swap_kernel(X, W, Y, WS, B, M, N, K, K_SPLIT, stride_x, stride_y,
                          BLOCK_W: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, ADD: tl.constexpr, PARTIAL: tl.constexpr):
    # NOTE: Y^T = W X^T: a wide W tile widened in registers as the MMA's first operand, so each
    # of x's rows is read once per BLOCK_W weight rows, not per BLOCK_N; a K split (PARTIAL:
    # float32 partials, summed by _sum_splits_kernel) gives a narrow N enough programs
    pid_w, pid_x, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rw = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    rx = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    rk = tl.arange(0, BLOCK_K)
    k0 = split * K_SPLIT
    k_len = tl.minimum(K_SPLIT, K - k0)
    w_ptr = W + rw[:, None].to(tl.int64) * K + k0 + rk[None, :]
    x_ptr = X + rx[None, :].to(tl.int64) * stride_x + k0 + rk[:, None]
    acc = tl.zeros((BLOCK_W, BLOCK_X), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        kmask = rk < k_len - k * BLOCK_K
        w = tl.load(w_ptr, mask=(rw[:, None] < N) & kmask[None, :], other=0.0)
        x = tl.load(x_ptr, mask=(rx[None, :] < M) & kmask[:, None], other=0.0)
        acc = tl.dot(w.to(x.dtype), x, acc)
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    acc = acc * tl.load(WS + rw, mask=rw < N, other=0.0)[:, None]
    ymask = (rw[:, None] < N) & (rx[None, :] < M)
    if PARTIAL:
        p_ptr = Y + split.to(tl.int64) * M * N + rx[None, :].to(tl.int64) * N + rw[:, None]
        tl.store(p_ptr, acc, mask=ymask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + rw, mask=rw < N, other=0.0).to(tl.float32)[:, None]
        y_ptr = Y + rx[None, :].to(tl.int64) * stride_y + rw[:, None]
        if ADD:
            acc += tl.load(y_ptr, mask=ymask, other=0.0).to(tl.float32)
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=ymask)


@triton.jit
def _sum_splits_kernel(P, Y, B, M, N, SPLITS, stride_y, HAS_BIAS: tl.constexpr,
                       ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLITS):  # NOTE: a fixed order: the same sum on every run
        acc += tl.load(P + (s * M + row).to(tl.int64) * N + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=mask, other=0.0).to(tl.float32)
    y_ptr = Y + row.to(tl.int64) * stride_y + rn
    if ADD:
        acc += tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)


def swap_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int] | None:
    """(BLOCK_W, BLOCK_X, BLOCK_K, splits, warps, stages) of the swapped GEMM (weights only), or
    None for _fp8_gemm_kernel (bench/README.md#fp8-gemm-configs): from 17 to 64 rows, where x
    re-read per narrow weight tile bounds the plain kernel; K split in two for deep weights."""
    if not 16 < m <= 64:
        return None
    return 64, 64 if m > 32 else 32, 128, 2 if k >= 3 * n else 1, 4, 3


def _swap_gemm(x, w8, scales, bias, into, cfg) -> torch.Tensor:
    m, k = x.shape
    n = w8.shape[0]
    bw, bx, bk, splits, warps, stages = cfg
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    y = into if into is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else scales.weight
    grid = (triton.cdiv(n, bw), triton.cdiv(m, bx), splits)
    _fp8_gemm_swap_kernel[grid](x, w8, out, scales.weight, b, m, n, k, k_split, x.stride(0),
                                y.stride(0), BLOCK_W=bw, BLOCK_X=bx, BLOCK_K=bk,
                                HAS_BIAS=bias is not None, ADD=into is not None,
                                PARTIAL=splits > 1, num_warps=warps, num_stages=stages)
    if splits > 1:
        _sum_splits_kernel[(m, triton.cdiv(n, 1024))](out, y, b, m, n, splits, y.stride(0),
                                                      HAS_BIAS=bias is not None,
                                                      ADD=into is not None, BLOCK=1024)
    return y


DEQUANT_ROWS = 512  # NOTE: from here (not in a graph) W widened once + cuBLAS wins (bench/README.md#fp8-gemm-configs)


@triton.jit
def _dequantize_kernel(W, S, OUT, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(S + row)
    for start in range(0, K, BLOCK):
        rk = start + tl.arange(0, BLOCK)
        w = tl.load(W + row * K + rk, mask=rk < K, other=0.0).to(tl.float32)
        tl.store(OUT + row * K + rk, (w * s).to(OUT.dtype.element_ty), mask=rk < K)


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 [N, K] * scale [N] in float32, rounded to dtype, in one kernel (a program a row)."""
    n, k = w8.shape
    out = torch.empty(n, k, dtype=dtype, device=w8.device)
    _dequantize_kernel[(n,)](w8, scale, out, k, BLOCK=1024, num_warps=4)
    return out


def fp8_gemm(x: torch.Tensor, w8: torch.Tensor, scales: Fp8Scales,
             bias: torch.Tensor | None = None, into: torch.Tensor | None = None
             ) -> torch.Tensor:
    """x [M, K] (unit column stride) against W8 [N, K] contiguous -> [M, N] in x's dtype (or
    added into `into`)."""
    m, k = x.shape
    n = w8.shape[0]
    assert x.stride(1) == 1 and w8.is_contiguous() and w8.shape[1] == k
    assert scales.weight.shape == (n,) and scales.weight.dtype == torch.float32
    if (not scales.quantize_inputs and m >= DEQUANT_ROWS
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        y = F.linear(x, dequantize_weight(w8, scales.weight, x.dtype), bias)
        return y if into is None else into.add_(y)
    cfg = None if scales.quantize_inputs else swap_config(m, n, k)
    if cfg is not None:
        return _swap_gemm(x, w8, scales, bias, into, cfg)
    y = into if into is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    xs = scales.weight  # NOTE: a placeholder pointer where x is not quantized
    if scales.quantize_inputs:
        x, xs = quantize_rows(x, scales.input)
    bm, bn, bk, warps, stages = gemm_config(m, n, k, scales.quantize_inputs)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](x, w8, y, scales.weight, xs, bias if bias is not None else xs, m, n, k,
                           x.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                           X_FP8=scales.quantize_inputs, HAS_BIAS=bias is not None,
                           ADD=into is not None, GROUP_M=8, num_warps=warps, num_stages=stages)
    return y
