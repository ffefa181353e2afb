"""gemv_rotary_store with a q/k norm (Qwen3, Gemma 3): one row's qkv product, then each head
normed, rotated and stored.

A head's rows span several programs, so no program holds a head whole: each stores its rows,
then takes a ticket per head; the last of a head's programs to finish norms, rotates and stores
the head (q in place, k and v into the paged cache). The weights stream as gemv.py's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.elementwise import rotate_heads
from hsserve.kernels.fp8 import Fp8Scales
from hsserve.kernels.gemv import (_W_POLICY, _launch_args, _row_scales, _scale_args, _shapes_fit,
                                  _slab, _x_row, gemv_config)
from hsserve.kernels.pdl import pdl_enter


@triton.jit
def _gemv_head_norm_kernel(X, W, QKV, COS, SIN, KV, SLOTS, QW, KW, TICKETS, K, eps, qk_eps,
                           stride_c, stride_half, stride_slot, stride_head,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                           HAS_RMS: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr,
                           WS, XS, HAS_SCALE: tl.constexpr, QUANT_X: tl.constexpr):
    # NOTE: one row; a program owns BLOCK_N rows of one head; the last of a head's programs
    # to finish (its ticket) norms, rotates and stores the head whole
    rn, rk, kmask, w = _slab(W, K, BLOCK_N, KP, W_POLICY)
    ws = _row_scales(WS, rn, HAS_SCALE)
    pdl_enter(PDL)
    x = _x_row(X, rk, kmask, XS, QUANT_X)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1) * ws
    tl.store(QKV + rn, acc.to(QKV.dtype.element_ty))
    head = tl.program_id(0) * BLOCK_N // (2 * HALF)
    tl.debug_barrier()  # NOTE: every thread's rows stored before the ticket
    if tl.atomic_add(TICKETS + head, 1, sem="acq_rel", scope="gpu") == 2 * HALF // BLOCK_N - 1:
        tl.store(TICKETS + head, 0)  # NOTE: zero again for the next launch
        scale = 1.0
        if HAS_RMS:  # NOTE: the folded norm's 1 / rms of x, as rotary_store_'s
            scale = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        _store_head(QKV, COS, SIN, KV, SLOTS, QW, KW, head, scale, qk_eps, stride_c, stride_half,
                    stride_slot, stride_head, NUM_HEADS, NUM_KV_HEADS, HALF)


@triton.jit
def _store_head(QKV, COS, SIN, KV, SLOTS, QW, KW, head, scale, qk_eps, stride_c, stride_half,
                stride_slot, stride_head, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                HALF: tl.constexpr):
    """rotary_store_ with q/k norm for one head of one row (its values from L2: other programs
    wrote them): a q head normed and rotated in place, a k head normed, rotated and written to
    the cache, a v head scaled and written."""
    i = tl.arange(0, HALF)[None, :]
    slot = tl.load(SLOTS).to(tl.int64)
    if head < NUM_HEADS + NUM_KV_HEADS:
        nw = QW if head < NUM_HEADS else KW
        a, b, _, src = rotate_heads(QKV, COS, SIN, 0, head, 0, 2 * HALF, stride_c, scale, nw,
                                    qk_eps, 1, 1, HALF, True, ".cg")
        if head < NUM_HEADS:
            tl.store(src, a)
            tl.store(src + HALF, b)
        elif slot >= 0:
            dst = KV + slot * stride_slot + (head - NUM_HEADS) * stride_head + i
            tl.store(dst, a)
            tl.store(dst + HALF, b)
    elif slot >= 0:  # NOTE: a v head
        src = QKV + head * 2 * HALF + i
        v1 = tl.load(src, cache_modifier=".cg").to(tl.float32) * scale
        v2 = tl.load(src + HALF, cache_modifier=".cg").to(tl.float32) * scale
        kvh = head - NUM_HEADS - NUM_KV_HEADS
        dst = KV + stride_half + slot * stride_slot + kvh * stride_head + i
        tl.store(dst, v1.to(KV.dtype.element_ty))
        tl.store(dst + HALF, v2.to(KV.dtype.element_ty))


def head_norm_fits(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Whether gemv_head_norm_store takes x W^T: one row as gemv_fits has it (on any device:
    the interpreter's tests), and a head's rows split evenly over the programs (gemv_config's
    rows a program divide head_dim)."""
    return (_shapes_fit(x, w) and len(x) == 1
            and head_dim % gemv_config(w.shape[0], w.shape[1], w.element_size())[0] == 0)


def gemv_head_norm_store(x: torch.Tensor, w: torch.Tensor, num_heads: int, num_kv_heads: int,
                         cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                         slots: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float],
                         tickets: torch.Tensor, rms_eps: float | None = None,
                         pdl: bool | None = None, scales: Fp8Scales | None = None) -> torch.Tensor:
    """One row's fused qkv product with W [(heads + 2 * kv_heads) * head_dim, K], then what
    rotary_store_ does with qk_norm (q weight, k weight, eps) and rms_of x: returns q [1, heads,
    head_dim] normed and rotated; k (normed, rotated) and v go into one layer's cache at the
    slot. tickets: int32 [heads + 2 * kv_heads], zero (zero again after). One launch. scales: W
    is float8 (kernels/fp8.py)."""
    rows, k, pdl = _launch_args(x, w, pdl, scales)
    assert rms_eps is None or scales is None or not scales.quantize_inputs
    d = kv.shape[-1]
    n = w.shape[0]
    assert rows == 1 and n == (num_heads + 2 * num_kv_heads) * d and head_norm_fits(x, w, d)
    assert tickets.dtype == torch.int32 and tickets.numel() >= n // d
    qkv = torch.empty(1, n, dtype=x.dtype, device=x.device)
    flat = kv.view(2, -1, num_kv_heads, d)
    qw, kw, qk_eps = qk_norm
    block_n, warps = gemv_config(n, k, w.element_size())
    _gemv_head_norm_kernel[(n // block_n,)](
        x, w, qkv, cos, sin, flat, slots, qw, kw, tickets, k, rms_eps or 0.0, qk_eps,
        cos.stride(0), flat.stride(0), flat.stride(1), flat.stride(2), NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HALF=d // 2, BLOCK_N=block_n, KP=triton.next_power_of_2(k),
        HAS_RMS=rms_eps is not None, PDL=pdl, W_POLICY=_W_POLICY, num_warps=warps,
        launch_pdl=pdl, **_scale_args(scales, w))
    return qkv.view(1, -1, d)[:, :num_heads]
