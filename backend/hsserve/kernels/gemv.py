"""y = x W^T for a few rows (decode at small batch), chained by programmatic dependent launch.

At one row a decode step is a chain of matrix-vector products, each reading its weight once. A
single product of 8-34 MB cannot fill the memory system on its own (cuBLAS reaches a third of
the bandwidth on the 1B shape's o_proj), and every kernel boundary drains it. Here each
program loads its slab of W (BLOCK_N whole rows, ~32 KB) before it waits for the previous kernel
(griddepcontrol.wait), and lets the next kernel launch at once (griddepcontrol.launch_dependents):
with PDL on, the next product's weights stream in while this one finishes, as in one persistent
kernel. The weights never depend on the previous kernel, so only x and y wait. They are loaded
evict_first: streamed through L2 once a step, they no longer push out what the step reads again
(activations, the KV cache, the attention splits' partials).

The plain product can also RMS-norm x first (the decoder's final norm before the lm_head, whose
weight is tied to the embedding and cannot take the norm's weight) and write float32 (logits).
Two products carry the kernel that followed them in their epilogue (and, for folded norms, the
1 / rms of x, which they hold whole anyway): gemv_silu_mul (the MLP's gate_up, then
SiLU-and-multiply) and gemv_rotary_store (attention's qkv, then rotary on q and k and the k/v
writes into the paged cache, as rotary_store_): one kernel instead of two, each. The q/k-norm
variant (Qwen3, Gemma 3) is gemv_head_norm.py's.

References: gemv_ref (F.linear) and silu_mul_ref, the oracles of the kernel tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hsserve.kernels.fp8 import Fp8Scales
from hsserve.kernels.pdl import pdl_enter, pdl_on

MAX_ROWS = 1  # NOTE: above one row cuBLAS wins (bench/README.md#gemv-slabs-and-pdl)
_SLAB_BYTES = 32 << 10  # NOTE: W bytes per program (bench/README.md#gemv-slabs-and-pdl)
# NOTE: streamed through L2 once a step, the weights go first (bench/README.md#gemv-evict-first)
_W_POLICY = "evict_first"
_MAX_ROW_BYTES = 32 << 10  # NOTE: one whole row of W per program at least; above this, cuBLAS


def gemv_fits(x: torch.Tensor, w: torch.Tensor | None) -> bool:
    """Whether gemv can take x W^T: CUDA, at most MAX_ROWS rows of unit stride, a contiguous W
    whose padded row fits a program."""
    return x.is_cuda and _shapes_fit(x, w)


def _shapes_fit(x: torch.Tensor, w: torch.Tensor | None) -> bool:
    return (x.dim() == 2 and 0 < len(x) <= MAX_ROWS and x.stride(1) == 1
            and w is not None and w.is_contiguous()
            and (w.dtype == x.dtype or w.dtype == torch.float8_e4m3fn)
            and triton.next_power_of_2(w.shape[1]) * w.element_size() <= _MAX_ROW_BYTES)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, w)
    return y if into is None else into.add_(y)


@triton.jit
def _x_row(x_row, rk, kmask, XS, QUANT_X: tl.constexpr):
    """One row of x in float32; QUANT_X 1 / 2: rounded to float8 by its own amax / 448 or by
    the static scale XS (quantize_rows_ref's rounding)."""
    x = tl.load(x_row + rk, mask=kmask, other=0.0).to(tl.float32)
    if QUANT_X != 0:
        if QUANT_X == 1:
            s = tl.div_rn(tl.max(tl.abs(x), 0), 448.0)
            s = tl.where(s == 0.0, 1.1920928955078125e-07, s)
        else:
            s = tl.load(XS)
        x = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        x = x * s  # NOTE: div_rn: torch's correctly rounded division, so the same float8
    return x


@triton.jit
def _row_scales(WS, rows, HAS_SCALE: tl.constexpr):
    """The float8 weight rows' scales (1 for a plain weight)."""
    if HAS_SCALE:
        s = tl.load(WS + rows)
    else:
        s = 1.0  # NOTE: one return: Triton types every return of a function alike
    return s


@triton.jit
def _weights(ptrs, kmask, POLICY: tl.constexpr):
    """A slab of W [rows, KP] (columns past K zero), loaded with the weights' L2 policy."""
    return tl.load(ptrs, mask=kmask[None, :], other=0.0, eviction_policy=POLICY)


@triton.jit
def _slab(W, K, BLOCK_N: tl.constexpr, KP: tl.constexpr, POLICY: tl.constexpr):
    """This program's BLOCK_N whole rows of W: (their indices, the columns, their mask, the
    slab)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, KP)
    kmask = rk < K
    return rn, rk, kmask, _weights(W + rn[:, None].to(tl.int64) * K + rk[None, :], kmask, POLICY)


@triton.jit
def _gemv_kernel(X, W, Y, NW, WS, XS, K, eps, stride_x, stride_y, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, KP: tl.constexpr, ADD: tl.constexpr,
                 HAS_NORM: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr,
                 HAS_SCALE: tl.constexpr, QUANT_X: tl.constexpr):
    rn, rk, kmask, w = _slab(W, K, BLOCK_N, KP, W_POLICY)
    ws = _row_scales(WS, rn, HAS_SCALE)
    if HAS_NORM:
        nw = tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)
    pdl_enter(PDL)  # NOTE: x and y come from the previous kernel; W did not
    for m in tl.static_range(ROWS):
        x = _x_row(X + m * stride_x, rk, kmask, XS, QUANT_X)
        if HAS_NORM:
            x = x * tl.rsqrt(tl.sum(x * x, 0) / K + eps) * nw
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1) * ws
        if ADD:
            acc += tl.load(Y + m * stride_y + rn).to(tl.float32)
        tl.store(Y + m * stride_y + rn, acc.to(Y.dtype.element_ty))


def gemv_config(n: int, k: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps): BLOCK_N whole rows of ~_SLAB_BYTES per program, dividing n."""
    block_n = max(1, _SLAB_BYTES // (triton.next_power_of_2(k) * itemsize))
    while n % block_n:
        block_n //= 2
    slab = block_n * triton.next_power_of_2(k) * itemsize
    return block_n, 8 if slab > _SLAB_BYTES else 4


def _launch_args(x: torch.Tensor, w: torch.Tensor, pdl: bool | None,
                 scales: Fp8Scales | None = None) -> tuple[int, int, bool]:
    """(rows, K, pdl) of a product x W^T, its shapes checked (a float8 W with its scales);
    pdl None: where supported."""
    rows, k = x.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1 and w.is_contiguous() and w.shape[1] == k
    assert (w.dtype == torch.float8_e4m3fn) == (scales is not None)
    assert scales is None or scales.weight.shape == (w.shape[0],)
    return rows, k, pdl_on(x) if pdl is None else pdl


def _scale_args(scales: Fp8Scales | None, w: torch.Tensor) -> dict:
    """The kernels' float8 arguments: row scales, the static input scale, and the flags (a
    plain weight: W itself as the unread pointers)."""
    if scales is None:
        return dict(WS=w, XS=w, HAS_SCALE=False, QUANT_X=0)
    quant = 0 if not scales.quantize_inputs else (1 if scales.input is None else 2)
    return dict(WS=scales.weight, XS=scales.input if scales.input is not None else w,
                HAS_SCALE=True, QUANT_X=quant)


def gemv(x: torch.Tensor, w: torch.Tensor, into: torch.Tensor | None = None,
         pdl: bool | None = None, config: tuple[int, int] | None = None,
         out: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None,
         scales: Fp8Scales | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] (rows contiguous), w [N, K] contiguous -> [rows, N] in x's dtype
    (or written into `out`, [rows, N] of any float dtype); with `into` ([rows, N]) the product is
    added to it in place. norm (weight [K], eps): x's rows RMS-normed first (add_rmsnorm_ref's
    formula, kept in float32 where it rounds to x's dtype). scales: W is float8 (kernels/fp8.py).
    pdl None: where supported."""
    rows, k, pdl = _launch_args(x, w, pdl, scales)
    assert norm is None or scales is None
    n = w.shape[0]
    assert into is None or out is None
    y = into if into is not None else out
    assert y is None or (y.shape == (rows, n) and y.stride(1) == 1)
    if y is None:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (w, 0.0)
    assert norm is None or (nw.shape == (k,) and nw.is_contiguous())
    block_n, warps = config or gemv_config(n, k, w.element_size())
    _gemv_kernel[(n // block_n,)](x, w, y, nw, K=k, eps=eps, stride_x=x.stride(0),
                                  stride_y=y.stride(0), ROWS=rows, BLOCK_N=block_n,
                                  KP=triton.next_power_of_2(k), ADD=into is not None,
                                  HAS_NORM=norm is not None, PDL=pdl, W_POLICY=_W_POLICY,
                                  num_warps=warps, launch_pdl=pdl, **_scale_args(scales, w))
    return y


@triton.jit
def _two_products(x_row, w1, w2, rk, kmask, K, eps, HAS_RMS: tl.constexpr, XS,
                  QUANT_X: tl.constexpr):
    """One row of x against two slabs -> two float32 vectors, each scaled by the row's 1 / rms
    when HAS_RMS (the folded norm: the program holds the whole row anyway); x rounded to float8
    as _x_row's QUANT_X says."""
    x = _x_row(x_row, rk, kmask, XS, QUANT_X)
    a = tl.sum(w1.to(tl.float32) * x[None, :], axis=1)
    b = tl.sum(w2.to(tl.float32) * x[None, :], axis=1)
    if HAS_RMS:
        scale = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        a, b = a * scale, b * scale
    return a, b


@triton.jit
def _gemv_silu_mul_kernel(X, W, Y, WS, XS, K, half, eps, stride_x, stride_y, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, KP: tl.constexpr, HAS_RMS: tl.constexpr,
                          PDL: tl.constexpr, W_POLICY: tl.constexpr, HAS_SCALE: tl.constexpr,
                          QUANT_X: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, KP)
    kmask = rk < K
    gate = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    wg = _weights(gate, kmask, W_POLICY)
    wu = _weights(gate + half.to(tl.int64) * K, kmask, W_POLICY)
    sg, su = _row_scales(WS, rn, HAS_SCALE), _row_scales(WS, rn + half, HAS_SCALE)
    pdl_enter(PDL)
    for m in tl.static_range(ROWS):
        g, u = _two_products(X + m * stride_x, wg, wu, rk, kmask, K, eps, HAS_RMS, XS, QUANT_X)
        g, u = g * sg, u * su
        tl.store(Y + m * stride_y + rn, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty))


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, rms_eps: float | None = None,
                  pdl: bool | None = None, scales: Fp8Scales | None = None) -> torch.Tensor:
    """silu(gate) * up of x W^T for a fused gate_up W [2 * I, K] -> [rows, I]; with rms_eps, gate
    and up are first scaled by each x row's 1 / rms (the folded norm, as silu_mul's rms_of).
    scales: W is float8 (kernels/fp8.py; not with rms_eps where x is quantized)."""
    rows, k, pdl = _launch_args(x, w, pdl, scales)
    assert rms_eps is None or scales is None or not scales.quantize_inputs
    half = w.shape[0] // 2
    y = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block_n, warps = gemv_config(half, k, 2 * w.element_size())  # NOTE: two slabs a program
    _gemv_silu_mul_kernel[(half // block_n,)](
        x, w, y, K=k, half=half, eps=rms_eps or 0.0, stride_x=x.stride(0), stride_y=y.stride(0),
        ROWS=rows, BLOCK_N=block_n, KP=triton.next_power_of_2(k), HAS_RMS=rms_eps is not None,
        PDL=pdl, W_POLICY=_W_POLICY, num_warps=warps, launch_pdl=pdl, **_scale_args(scales, w))
    return y


@triton.jit
def _gemv_rotary_store_kernel(X, W, Q, COS, SIN, KV, SLOTS, K, eps, stride_x, stride_qt,
                              stride_qh, stride_c, stride_half, stride_slot, stride_head,
                              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                              HALF: tl.constexpr, PAIRS: tl.constexpr, KP: tl.constexpr,
                              ROWS: tl.constexpr, HAS_RMS: tl.constexpr, PDL: tl.constexpr,
                              W_POLICY: tl.constexpr, WS, XS, HAS_SCALE: tl.constexpr,
                              QUANT_X: tl.constexpr):
    # NOTE: a program owns PAIRS rotation pairs of one head: W rows i and i + HALF of it
    pid = tl.program_id(0)
    head = pid * PAIRS // HALF
    i = pid * PAIRS % HALF + tl.arange(0, PAIRS)
    rk = tl.arange(0, KP)
    kmask = rk < K
    lo = W + (head * 2 * HALF + i)[:, None].to(tl.int64) * K + rk[None, :]
    w1 = _weights(lo, kmask, W_POLICY)
    w2 = _weights(lo + HALF * K, kmask, W_POLICY)
    row = head * 2 * HALF + i
    s1, s2 = _row_scales(WS, row, HAS_SCALE), _row_scales(WS, row + HALF, HAS_SCALE)
    pdl_enter(PDL)
    for m in tl.static_range(ROWS):
        a, b = _two_products(X + m * stride_x, w1, w2, rk, kmask, K, eps, HAS_RMS, XS, QUANT_X)
        a, b = a * s1, b * s2
        if head < NUM_HEADS + NUM_KV_HEADS:  # NOTE: q and k rotate; v does not
            c = tl.load(COS + m * stride_c + i)
            sn = tl.load(SIN + m * stride_c + i)
            a, b = a * c - b * sn, b * c + a * sn
        if head < NUM_HEADS:
            dst = Q + m * stride_qt + head * stride_qh + i
            tl.store(dst, a.to(Q.dtype.element_ty))
            tl.store(dst + HALF, b.to(Q.dtype.element_ty))
        else:
            slot = tl.load(SLOTS + m).to(tl.int64)
            if slot >= 0:
                v = (head >= NUM_HEADS + NUM_KV_HEADS).to(tl.int64)
                kvh = head - NUM_HEADS - v * NUM_KV_HEADS
                dst = KV + v * stride_half + slot * stride_slot + kvh * stride_head + i
                tl.store(dst, a.to(KV.dtype.element_ty))
                tl.store(dst + HALF, b.to(KV.dtype.element_ty))


def gemv_rotary_store(x: torch.Tensor, w: torch.Tensor, num_heads: int, num_kv_heads: int,
                      cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                      rms_eps: float | None = None, pdl: bool | None = None,
                      scales: Fp8Scales | None = None) -> torch.Tensor:
    """The fused qkv product of x with W [(heads + 2 * kv_heads) * head_dim, K], then what
    rotary_store_ does with it: returns q [rows, heads, head_dim] rotated; k rotated and v go
    into one layer's cache [2, blocks, block_size, kv_heads, head_dim] at `slots` (negative: not
    written); cos/sin [rows, head_dim // 2] float32. rms_eps: scaled first by x's rows' 1 / rms.
    scales: W is float8 (kernels/fp8.py)."""
    rows, k, pdl = _launch_args(x, w, pdl, scales)
    assert rms_eps is None or scales is None or not scales.quantize_inputs
    d = kv.shape[-1]
    assert w.shape[0] == (num_heads + 2 * num_kv_heads) * d
    q = torch.empty(rows, num_heads, d, dtype=x.dtype, device=x.device)
    flat = kv.view(2, -1, num_kv_heads, d)
    pairs, warps = gemv_config(d // 2, k, 2 * w.element_size())  # NOTE: two slabs a program
    _gemv_rotary_store_kernel[(w.shape[0] // 2 // pairs,)](
        x, w, q, cos, sin, flat, slots, k, rms_eps or 0.0, x.stride(0), q.stride(0), q.stride(1),
        cos.stride(0), flat.stride(0), flat.stride(1), flat.stride(2), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HALF=d // 2, PAIRS=pairs, KP=triton.next_power_of_2(k),
        ROWS=rows, HAS_RMS=rms_eps is not None, PDL=pdl, W_POLICY=_W_POLICY,
        num_warps=warps, launch_pdl=pdl, **_scale_args(scales, w))
    return q
