"""Linear layers of a small decode batch (CUDA): weight-streaming kernels with what surrounds
each product fused in, so a decoder layer is 6 launches instead of 10.

At a few rows a linear layer is a pass over its weight; what costs is every extra launch and
every round trip of the small activations between them. One kernel, `_linear_kernel`, streams a
tile of weight rows per program over all K and multiplies the (padded) rows with tl.dot; around
it, selected by constexpr switches:

- NORM (prologue): 0 plain; 1 RMSNorm of x; 2 RMSNorm of x + residual, whose sum program 0 also
  stores (the next residual). The norm is applied after the product: y = rstd * ((x * g) W^T),
  the sum of squares accumulates in the same pass over K.
- EPI (epilogue): 0 store y; 1 silu(gate) * up, a program holding matching gate and up rows
  (the fused gate_up weight); 2 rotary on q and k and k/v written into the paged cache, a
  program holding matching halves of one head's rows (the fused qkv weight).

Each function beside its torch reference (the composition the CPU path runs), which the tests use
as the oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hsserve.kernels.elementwise import add_rmsnorm_ref, silu_mul_ref

MAX_ROWS = 16  # NOTE: above this the decode step's GEMMs go to cuBLAS
_DOT_FROM = 4  # NOTE: up to this many rows the product runs on CUDA cores, above on tl.dot
_PLAIN, _SILU_MUL, _ROPE_STORE = 0, 1, 2


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, IEEE: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed, float32: tl.dot (BLOCK_M >= 16,
    rows padded) or, for 1-4 rows, a broadcast multiply summed over K on the CUDA cores."""
    if USE_DOT:
        if IEEE:
            return tl.dot(x, tl.trans(w), input_precision="ieee")
        return tl.dot(x, tl.trans(w))
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _linear_kernel(
    X, R, RES_OUT, G, W, BIAS, Y,
    COS, SIN, KV, SLOTS,
    M, N, K, eps, second,
    stride_xm, stride_rm, stride_om, stride_wn, stride_ym, stride_cm,
    stride_kv_half, stride_kv_slot, stride_kv_head,
    NORM: tl.constexpr, EPI: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    j = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if EPI == 2:  # NOTE: j counts rotation pairs; a tile lies inside one head
        half: tl.constexpr = HEAD_DIM // 2
        head = (pid * BLOCK_N) // half
        i = j % half
        rows1 = head * HEAD_DIM + i
        rows2 = rows1 + half
        n_ok = j < N
    else:
        rows1 = j
        rows2 = j + second
        n_ok = j < N
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + m[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0)
        if NORM == 2:
            x = x + tl.load(R + m[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0)
            if pid == 0:
                tl.store(RES_OUT + m[:, None] * stride_om + ks[None, :], x, mask=xm)
        xf = x.to(tl.float32)
        if NORM > 0:
            ss += tl.sum(xf * xf, 1)
            xf = xf * tl.load(G + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        xw = xf.to(W.dtype.element_ty)
        wm = n_ok[:, None] & k_ok[None, :]
        w1 = tl.load(W + rows1[:, None] * stride_wn + ks[None, :], mask=wm, other=0.0)
        acc1 += _tile_product(xw, w1, USE_DOT, IEEE)
        if EPI != 0:
            w2 = tl.load(W + rows2[:, None] * stride_wn + ks[None, :], mask=wm, other=0.0)
            acc2 += _tile_product(xw, w2, USE_DOT, IEEE)
    if NORM > 0:
        rstd = tl.rsqrt(ss / K + eps)
        acc1 = acc1 * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if HAS_BIAS:
        acc1 += tl.load(BIAS + rows1, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPI != 0:
            acc2 += tl.load(BIAS + rows2, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if EPI == 0:
        tl.store(Y + m[:, None] * stride_ym + rows1[None, :], acc1.to(Y.dtype.element_ty),
                 mask=out_mask)
    elif EPI == 1:
        y = acc1 / (1.0 + tl.exp(-acc1)) * acc2
        tl.store(Y + m[:, None] * stride_ym + rows1[None, :], y.to(Y.dtype.element_ty),
                 mask=out_mask)
    else:
        if head < NUM_HEADS + NUM_KV_HEADS:  # q or k: rotate
            c = tl.load(COS + m[:, None] * stride_cm + i[None, :], mask=out_mask, other=0.0)
            s = tl.load(SIN + m[:, None] * stride_cm + i[None, :], mask=out_mask, other=0.0)
            o1 = acc1 * c - acc2 * s
            o2 = acc2 * c + acc1 * s
        else:
            o1 = acc1
            o2 = acc2
        if head < NUM_HEADS:
            q = Y + m[:, None] * stride_ym + rows1[None, :]
            tl.store(q, o1.to(Y.dtype.element_ty), mask=out_mask)
            tl.store(q + half, o2.to(Y.dtype.element_ty), mask=out_mask)
        else:
            is_v = head >= NUM_HEADS + NUM_KV_HEADS
            kvh = head - NUM_HEADS - is_v * NUM_KV_HEADS
            slot = tl.load(SLOTS + m, mask=m_ok, other=-1).to(tl.int64)
            ptr = (KV + is_v * stride_kv_half + slot[:, None] * stride_kv_slot
                   + kvh * stride_kv_head + i[None, :])
            keep = out_mask & (slot >= 0)[:, None]
            tl.store(ptr, o1.to(KV.dtype.element_ty), mask=keep)
            tl.store(ptr + half, o2.to(KV.dtype.element_ty), mask=keep)


def default_config(n_tiles_of_16: int, k: int, pairs: bool) -> dict:
    """Tile width, K step, warps and pipeline depth (measured on the H200: bench/gpu_linear.py)."""
    block_n = 16 if pairs or n_tiles_of_16 < 512 else 32
    return dict(BLOCK_N=block_n, BLOCK_K=256 if k >= 256 else triton.next_power_of_2(k),
                num_warps=4, num_stages=4)


def _launch(x, residual, g, eps, weight, bias, y, n, epi, second=0, rope=None, config=None):
    m, k = x.shape
    if residual is not None:
        norm, res_out = 2, torch.empty_like(x)
    else:
        norm, res_out = (1 if g is not None else 0), x
    cfg = dict(config or default_config(-(-n // 16), k, epi != _PLAIN))
    if epi == _ROPE_STORE:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], rope["head_dim"] // 2)
    cos, sin, kv, slots = (rope[name] for name in ("cos", "sin", "kv", "slots")) if rope else (x,) * 4
    kv_strides = (kv.stride(0), kv.stride(1), kv.stride(2)) if rope else (0, 0, 0)
    r = residual if residual is not None else x
    block_m = triton.next_power_of_2(m) if m <= _DOT_FROM else max(16, triton.next_power_of_2(m))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _linear_kernel[grid](
        x, r, res_out, g if g is not None else x, weight, bias if bias is not None else x, y,
        cos, sin, kv, slots,
        m, n, k, eps, second,
        x.stride(0), r.stride(0), res_out.stride(0), weight.stride(0), y.stride(0),
        cos.stride(0),
        *kv_strides,
        NORM=norm, EPI=epi, HAS_BIAS=bias is not None,
        HEAD_DIM=rope["head_dim"] if rope else 16,
        NUM_HEADS=rope["heads"] if rope else 0, NUM_KV_HEADS=rope["kv_heads"] if rope else 0,
        BLOCK_M=block_m, USE_DOT=block_m >= 16, IEEE=weight.dtype == torch.float32, **cfg,
    )
    return res_out


# ---- the four uses --------------------------------------------------------------------------------


def linear(x, weight, bias=None, out=None, config=None):
    """x W^T (+ b) into `out` (any float dtype, e.g. float32 logits) or a new tensor of x's dtype."""
    n = weight.shape[0]
    y = torch.empty(len(x), n, dtype=x.dtype, device=x.device) if out is None else out
    if len(x):
        _launch(x, None, None, 0.0, weight, bias, y, n, _PLAIN, config=config)
    return y


def norm_linear(x, residual, g, eps, weight, bias=None, out=None, config=None):
    """(RMSNorm(x + residual) W^T (+ b), x + residual); residual None: no add (the sum is x)."""
    n = weight.shape[0]
    y = torch.empty(len(x), n, dtype=x.dtype, device=x.device) if out is None else out
    total = _launch(x, residual, g, eps, weight, bias, y, n, _PLAIN, config=config)
    return y, total


def norm_gate_up_silu(x, residual, g, eps, weight, config=None):
    """(silu(gate) * up of RMSNorm(x + residual) W^T for the fused [gate; up] weight, the sum)."""
    n = weight.shape[0] // 2
    y = torch.empty(len(x), n, dtype=x.dtype, device=x.device)
    total = _launch(x, residual, g, eps, weight, None, y, n, _SILU_MUL, second=n, config=config)
    return y, total


def norm_qkv_rope_store(x, residual, g, eps, weight, bias, cos, sin, kv, slots,
                        heads, kv_heads, head_dim, config=None):
    """RMSNorm(x + residual) through the fused [q; k; v] weight; q and k rotated (rotate-half,
    float32 cos/sin [tokens, head_dim // 2]); k and v written into the layer's cache `kv`
    [2, blocks, block_size, kv_heads, head_dim] at `slots` (negative: skipped). Returns
    (q [tokens, heads, head_dim], x + residual)."""
    q = torch.empty(len(x), heads, head_dim, dtype=x.dtype, device=x.device)
    flat = kv.view(2, -1, kv_heads, head_dim)
    rope = dict(cos=cos, sin=sin, kv=flat, slots=slots, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim)
    pairs = (heads + 2 * kv_heads) * head_dim // 2
    total = _launch(x, residual, g, eps, weight, bias, q.view(len(x), -1), pairs, _ROPE_STORE,
                    rope=rope, config=config)
    return q, total


# ---- torch references -----------------------------------------------------------------------------


def norm_linear_ref(x, residual, g, eps, weight, bias=None):
    normed, total = add_rmsnorm_ref(x, residual, g, eps)
    return F.linear(normed, weight, bias), total


def norm_gate_up_silu_ref(x, residual, g, eps, weight):
    y, total = norm_linear_ref(x, residual, g, eps, weight)
    return silu_mul_ref(y), total


def norm_qkv_rope_store_ref(x, residual, g, eps, weight, bias, cos, sin, kv, slots,
                            heads, kv_heads, head_dim):
    from hsserve.kernels.paged_attention_ref import write_kv
    from hsserve.models.rope import apply_rotary

    y, total = norm_linear_ref(x, residual, g, eps, weight, bias)
    qkv = y.view(len(x), heads + 2 * kv_heads, head_dim)
    full_cos, full_sin = torch.cat((cos, cos), -1).to(x.dtype), torch.cat((sin, sin), -1).to(x.dtype)
    qk = apply_rotary(qkv[:, : heads + kv_heads], full_cos, full_sin)
    q, k = qk.split((heads, kv_heads), dim=1)
    keep = slots >= 0
    write_kv(kv, k[keep], qkv[keep, heads + kv_heads :], slots[keep])
    return q.contiguous(), total
