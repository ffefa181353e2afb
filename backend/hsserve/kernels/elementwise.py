"""Fused elementwise kernels for the decoder on CUDA, each beside its torch reference.

- add_rmsnorm: (x + residual) -> (RMSNorm of the sum, the sum): one pass instead of ~8 kernels.
- rotary_: rotate q and k heads in place from float32 cos/sin of each token's position.
- silu_mul: silu(gate) * up from the fused gate_up output.
- embed_rotary: a forward's first kernel: the tokens' embedding rows and the float32 cos / sin of
  their positions' rotary angles (five torch kernels otherwise, each a gap in a decode graph).

With the norms folded into the GEMMs (Decoder.fold_norms) a GEMM reads the residual stream itself
and its output rows still need the norm's 1 / rms(row): rotary_store_ and silu_mul take the
stream (`rms_of`) and apply that scale to what they read, so no norm kernel runs between layers.

Every kernel computes in float32 and rounds once to the tensor's dtype; the references are the
formulas the CPU path runs (and the test oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from hsserve.kernels.pdl import pdl_enter, pdl_on

# ---- embedding and rotary angles --------------------------------------------------------------


def embed_rotary_ref(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                     inv_freq: torch.Tensor):
    """(embed rows of ids [rows, hidden], cos [rows, half], sin [rows, half]), the angles
    float32 positions x inverse frequencies."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return F.embedding(ids, embed), freqs.cos(), freqs.sin()


@triton.jit
def _embed_rotary_kernel(IDS, POS, E, FREQ, X, COS, SIN, hidden, half, BLOCK: tl.constexpr,
                         HALF: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    row = tl.load(IDS + t).to(tl.int64)
    tl.store(X + t * hidden + cols, tl.load(E + row * hidden + cols, mask=cols < hidden),
             mask=cols < hidden)
    j = tl.arange(0, HALF)
    angle = tl.load(POS + t).to(tl.float32) * tl.load(FREQ + j, mask=j < half, other=0.0)
    if LIBDEVICE:  # NOTE: CUDA's accurate cosf / sinf (angles reach 1e5 rad), as torch's
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:  # NOTE: the interpreter (numpy)
        cos, sin = tl.cos(angle), tl.sin(angle)
    tl.store(COS + t * half + j, cos, mask=j < half)
    tl.store(SIN + t * half + j, sin, mask=j < half)


def embed_rotary(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                 inv_freq: torch.Tensor):
    """The kernel on CUDA (contiguous embed and float32 inv_freq), the reference elsewhere."""
    if not ids.is_cuda or not embed.is_contiguous() or inv_freq.dtype != torch.float32:
        return embed_rotary_ref(ids, positions, embed, inv_freq)
    return embed_rotary_triton(ids, positions, embed, inv_freq)


def embed_rotary_triton(ids, positions, embed, inv_freq):
    rows, (hidden, half) = len(ids), (embed.shape[1], len(inv_freq))
    x = torch.empty(rows, hidden, dtype=embed.dtype, device=embed.device)
    cos = torch.empty(rows, half, dtype=torch.float32, device=embed.device)
    sin = torch.empty_like(cos)
    if rows:
        _embed_rotary_kernel[(rows,)](ids, positions, embed, inv_freq, x, cos, sin, hidden, half,
                                      BLOCK=triton.next_power_of_2(hidden),
                                      HALF=triton.next_power_of_2(half),
                                      LIBDEVICE=not triton.knobs.runtime.interpret)
    return x, cos, sin

# ---- 1 / rms of a row -------------------------------------------------------------------------------


def rms_inverse_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[rows, 1] float32 (float64 for float64 x): 1 / sqrt(mean(x^2) + eps) of each row, as
    RMSNorm computes it."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


@triton.jit
def _rms_inverse(S, t, stride_s, n, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(S + t * stride_s + cols, mask=cols < n, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 0) / n + eps)


def _rms_args(rms_of: torch.Tensor | None, like: torch.Tensor):
    """(tensor, row stride, width, BLOCK) of the rows to scale by, or placeholders."""
    if rms_of is None:
        return like, 0, 1, 1
    return rms_of, rms_of.stride(0), rms_of.shape[-1], triton.next_power_of_2(rms_of.shape[-1])


# ---- RMSNorm with the residual add --------------------------------------------------------------


def add_rmsnorm_ref(x, residual, weight, eps):
    """Returns (normed, x + residual); residual None means no add (the sum is x)."""
    if residual is not None:
        x = x + residual
    if x.dtype == torch.float32:  # NOTE: one fused CPU kernel; the same formula as below
        return F.rms_norm(x, weight.shape, weight, eps), x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


@triton.jit
def _add_rmsnorm_kernel(X, R, W, OUT, SUM, OUT64, stride_x, stride_r, stride_o, stride_s,
                        stride_64, n, eps, HAS_RES: tl.constexpr, HAS_OUT64: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(SUM + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype)
    normed = (w * y).to(OUT.dtype.element_ty)
    tl.store(OUT + row * stride_o + cols, normed, mask=mask)
    if HAS_OUT64:  # NOTE: the same rounded values, widened (a router's float64 input)
        tl.store(OUT64 + row * stride_64 + cols, normed.to(tl.float64), mask=mask)


def add_rmsnorm(x, residual, weight, eps, out64: torch.Tensor | None = None):
    """The Triton kernel on CUDA, the compiled one on the CPU (float32 rows), else the reference.
    out64 (x's shape, float64): also given the normed rows, widened (in the kernel on CUDA)."""
    if x.is_cuda:
        return add_rmsnorm_triton(x, residual, weight, eps, out64)
    if _cpu_kernel_takes(x, residual, weight) and x.dim() == 2:
        from hsserve.kernels import cpu_ops

        normed, total = cpu_ops.add_rmsnorm(x, residual, weight, eps)  # NOTE: one pass
    else:
        normed, total = add_rmsnorm_ref(x, residual, weight, eps)
    if out64 is not None:
        out64.copy_(normed)
    return normed, total


def add_rmsnorm_triton(x, residual, weight, eps, out64: torch.Tensor | None = None):
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[-1]
    out = torch.empty_like(x2)
    total = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, n) if residual is not None else x2
    block = triton.next_power_of_2(n)
    pdl = pdl_on(x2)
    o64 = out64.view(-1, n) if out64 is not None else out
    if len(x2):
        _add_rmsnorm_kernel[(len(x2),)](
            x2, r2, weight, out, total, o64, x2.stride(0), r2.stride(0), out.stride(0),
            total.stride(0), o64.stride(0), n, eps, HAS_RES=residual is not None,
            HAS_OUT64=out64 is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
            PDL=pdl, launch_pdl=pdl,
        )
    return out.view(x.shape), total.view(x.shape)


# ---- rotary embeddings ----------------------------------------------------------------------------


@triton.jit
def rotate_heads(QKV, COS, SIN, t, h0, stride_t, stride_h, stride_c, scale, NW, eps,
                 COUNT: tl.constexpr, PAD: tl.constexpr, HALF: tl.constexpr,
                 NORM: tl.constexpr, CACHE: tl.constexpr):
    """Heads h0..h0+COUNT-1 of token t times `scale`, each RMS-normed by the weight NW [2 HALF]
    when NORM (Qwen3's q/k norm), rotated (float32 math, one rounding): two [PAD, HALF] halves
    and their row mask. CACHE: the loads' cache modifier (".cg": written by this launch)."""
    j = tl.arange(0, PAD)
    i = tl.arange(0, HALF)
    rows = (j < COUNT)[:, None]
    src = QKV + t * stride_t + (h0 + j)[:, None] * stride_h + i[None, :]
    x1 = tl.load(src, mask=rows, other=0.0, cache_modifier=CACHE)
    x2 = tl.load(src + HALF, mask=rows, other=0.0, cache_modifier=CACHE)
    c = tl.load(COS + t * stride_c + i)[None, :]
    s = tl.load(SIN + t * stride_c + i)[None, :]
    a, b = x1.to(tl.float32) * scale, x2.to(tl.float32) * scale
    if NORM:
        inv = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        a = a * inv * tl.load(NW + i).to(tl.float32)[None, :]
        b = b * inv * tl.load(NW + HALF + i).to(tl.float32)[None, :]
    return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype), rows, src


@triton.jit
def _rotary_kernel(X, COS, SIN, stride_t, stride_h, stride_c,
                   HEADS: tl.constexpr, PAD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    r1, r2, rows, src = rotate_heads(X, COS, SIN, t, 0, stride_t, stride_h, stride_c, 1.0, X,
                                     0.0, HEADS, PAD, HALF, False, "")
    tl.store(src, r1, mask=rows)
    tl.store(src + HALF, r2, mask=rows)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [tokens, heads, head_dim] (last dim contiguous) rotated in place (rotate-half layout);
    cos/sin [tokens, head_dim // 2] float32. One program per token."""
    t, h, d = x.shape
    if t:
        _rotary_kernel[(t,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                             HEADS=h, PAD=triton.next_power_of_2(h), HALF=d // 2)


@triton.jit
def _rotary_store_kernel(QKV, COS, SIN, KV, SLOTS, S, QW, KW, stride_t, stride_h, stride_c,
                         stride_half, stride_slot, stride_head, stride_s, n_s, eps, qk_eps,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                         HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HAS_RMS: tl.constexpr,
                         BLOCK_S: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr):
    # NOTE: one program per token, all its heads as one tile (a program per head left most
    # threads idle)
    pdl_enter(PDL)
    t = tl.program_id(0)
    i = tl.arange(0, HALF)
    scale = 1.0
    if HAS_RMS:
        scale = _rms_inverse(S, t, stride_s, n_s, eps, BLOCK_S)
    q1, q2, rows, src = rotate_heads(QKV, COS, SIN, t, 0, stride_t, stride_h, stride_c, scale,
                                     QW, qk_eps, NUM_HEADS, HEADS_PAD, HALF, QK_NORM, "")
    tl.store(src, q1, mask=rows)
    tl.store(src + HALF, q2, mask=rows)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        # NOTE: new names: a variable assigned in a branch keeps its type (shape) in Triton
        k1, k2, kv_rows, k_src = rotate_heads(QKV, COS, SIN, t, NUM_HEADS, stride_t, stride_h,
                                              stride_c, scale, KW, qk_eps, NUM_KV_HEADS, KV_PAD,
                                              HALF, QK_NORM, "")
        j = tl.arange(0, KV_PAD)
        dst = KV + slot * stride_slot + j[:, None] * stride_head + i[None, :]
        tl.store(dst, k1, mask=kv_rows)
        tl.store(dst + HALF, k2, mask=kv_rows)
        v = k_src + NUM_KV_HEADS * stride_h
        v1 = (tl.load(v, mask=kv_rows).to(tl.float32) * scale).to(k1.dtype)
        v2 = (tl.load(v + HALF, mask=kv_rows).to(tl.float32) * scale).to(k1.dtype)
        tl.store(dst + stride_half, v1, mask=kv_rows)
        tl.store(dst + stride_half + HALF, v2, mask=kv_rows)


def rotary_store_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                  sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                  rms_of: torch.Tensor | None = None, eps: float = 0.0,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> None:
    """One kernel for a fused qkv [tokens, heads + 2 * kv_heads, head_dim]: rotates the q heads in
    place and writes the rotated k heads and the v heads into one layer's cache
    [2, blocks, block_size, kv_heads, head_dim] at `slots` (negative: not written). The k heads
    of qkv are left unrotated (attention reads k from the cache). With `rms_of` [tokens, hidden],
    q, k and v are first scaled by each token's 1 / rms of that row (rms_inverse_ref). qk_norm
    (q weight, k weight [head_dim], eps): each q and k head RMS-normed before its rotation (the
    q/k norm of Qwen3 and Gemma 3, without rounding between the norm and the rotation)."""
    t, _, d = qkv.shape
    flat = kv.view(2, -1, num_kv_heads, d)
    s, stride_s, n_s, block_s = _rms_args(rms_of, qkv)
    qw, kw, qk_eps = qk_norm if qk_norm is not None else (qkv, qkv, 0.0)
    pdl = pdl_on(qkv)
    if t:
        _rotary_store_kernel[(t,)](
            qkv, cos, sin, flat, slots, s, qw, kw, qkv.stride(0), qkv.stride(1), cos.stride(0),
            flat.stride(0), flat.stride(1), flat.stride(2), stride_s, n_s, eps, qk_eps,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=d // 2,
            HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_PAD=triton.next_power_of_2(num_kv_heads),
            HAS_RMS=rms_of is not None, BLOCK_S=block_s, QK_NORM=qk_norm is not None, PDL=pdl,
            launch_pdl=pdl,
        )


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The same rotation (float32 math, one rounding) out of place; cos/sin as in rotary_."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)


# ---- SiLU and multiply ----------------------------------------------------------------------------


def silu_mul_ref(gate_up: torch.Tensor, rms_of: torch.Tensor | None = None,
                 eps: float = 0.0) -> torch.Tensor:
    """silu(gate) * up; with `rms_of`, of gate and up scaled by its rows' 1 / rms (float32 math,
    one rounding)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if rms_of is None:
        return F.silu(gate) * up
    inv = rms_inverse_ref(rms_of, eps)
    return (F.silu(gate * inv) * (up * inv)).to(gate_up.dtype)  # NOTE: promoted to inv's dtype


@triton.jit
def _silu_mul_kernel(X, OUT, S, stride_x, stride_o, stride_s, n, n_s, eps, BLOCK: tl.constexpr,
                     HAS_RMS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    scale = 1.0
    if HAS_RMS:
        scale = _rms_inverse(S, t, stride_s, n_s, eps, BLOCK_S)
    g = tl.load(X + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * scale
    u = tl.load(X + t * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32) * scale
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(OUT + t * stride_o + cols, y.to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, rms_of: torch.Tensor | None = None,
             eps: float = 0.0) -> torch.Tensor:
    """The Triton kernel on CUDA, the compiled one on the CPU (float32), else the reference."""
    if gate_up.is_cuda:
        return silu_mul_triton(gate_up, rms_of, eps)
    if rms_of is None and _cpu_kernel_takes(gate_up):
        from hsserve.kernels import cpu_ops

        return cpu_ops.silu_mul(gate_up)  # NOTE: one pass on the CPU
    return silu_mul_ref(gate_up, rms_of, eps)


def _cpu_kernel_takes(*tensors: torch.Tensor | None) -> bool:
    """float32 contiguous tensors (None: absent) and the CPU kernels' library loaded."""
    from hsserve.kernels import cpu_ops

    present = [t for t in tensors if t is not None]
    return (all(t.dtype == torch.float32 and t.is_contiguous() for t in present)
            and cpu_ops.library() is not None)


def silu_mul_triton(gate_up: torch.Tensor, rms_of: torch.Tensor | None = None,
                    eps: float = 0.0) -> torch.Tensor:
    t, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    s, stride_s, n_s, block_s = _rms_args(rms_of, gate_up)
    pdl = pdl_on(out)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            gate_up, out, s, gate_up.stride(0), out.stride(0), stride_s, n, n_s, eps,
            BLOCK=block, HAS_RMS=rms_of is not None, BLOCK_S=block_s, PDL=pdl, launch_pdl=pdl)
    return out
