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
writes into the paged cache, as rotary_store_): one kernel instead of two, each. With a q/k norm
(Qwen3, Gemma 3) a head's rows span several programs: in gemv_head_norm_store the last of them
to finish (a ticket per head) norms, rotates and stores the head.

References: gemv_ref (F.linear) and silu_mul_ref, the oracles of the kernel tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hsserve.kernels.elementwise import rotate_heads
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
            and w is not None and w.is_contiguous() and w.dtype == x.dtype
            and triton.next_power_of_2(w.shape[1]) * w.element_size() <= _MAX_ROW_BYTES)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x, w)
    return y if into is None else into.add_(y)


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
def _gemv_kernel(X, W, Y, NW, K, eps, stride_x, stride_y, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, KP: tl.constexpr, ADD: tl.constexpr,
                 HAS_NORM: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr):
    rn, rk, kmask, w = _slab(W, K, BLOCK_N, KP, W_POLICY)
    if HAS_NORM:
        nw = tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)
    pdl_enter(PDL)  # NOTE: x and y come from the previous kernel; W did not
    for m in tl.static_range(ROWS):
        x = tl.load(X + m * stride_x + rk, mask=kmask, other=0.0).to(tl.float32)
        if HAS_NORM:
            x = x * tl.rsqrt(tl.sum(x * x, 0) / K + eps) * nw
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
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


def _launch_args(x: torch.Tensor, w: torch.Tensor, pdl: bool | None) -> tuple[int, int, bool]:
    """(rows, K, pdl) of a product x W^T, its shapes checked; pdl None: where supported."""
    rows, k = x.shape
    assert rows <= MAX_ROWS and x.stride(1) == 1 and w.is_contiguous() and w.shape[1] == k
    return rows, k, pdl_on(x) if pdl is None else pdl


def gemv(x: torch.Tensor, w: torch.Tensor, into: torch.Tensor | None = None,
         pdl: bool | None = None, config: tuple[int, int] | None = None,
         out: torch.Tensor | None = None,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [rows <= MAX_ROWS, K] (rows contiguous), w [N, K] contiguous -> [rows, N] in x's dtype
    (or written into `out`, [rows, N] of any float dtype); with `into` ([rows, N]) the product is
    added to it in place. norm (weight [K], eps): x's rows RMS-normed first (add_rmsnorm_ref's
    formula, kept in float32 where it rounds to x's dtype). pdl None: where supported."""
    rows, k, pdl = _launch_args(x, w, pdl)
    n = w.shape[0]
    assert into is None or out is None
    y = into if into is not None else out
    assert y is None or (y.shape == (rows, n) and y.stride(1) == 1)
    if y is None:
        y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    nw, eps = norm if norm is not None else (w, 0.0)
    assert norm is None or (nw.shape == (k,) and nw.is_contiguous())
    block_n, warps = config or gemv_config(n, k, w.element_size())
    _gemv_kernel[(n // block_n,)](x, w, y, nw, k, eps, x.stride(0), y.stride(0), ROWS=rows,
                                  BLOCK_N=block_n, KP=triton.next_power_of_2(k),
                                  ADD=into is not None, HAS_NORM=norm is not None, PDL=pdl,
                                  W_POLICY=_W_POLICY, num_warps=warps, launch_pdl=pdl)
    return y


@triton.jit
def _two_products(x_row, w1, w2, rk, kmask, K, eps, HAS_RMS: tl.constexpr):
    """One row of x against two slabs -> two float32 vectors, each scaled by the row's 1 / rms
    when HAS_RMS (the folded norm: the program holds the whole row anyway)."""
    x = tl.load(x_row + rk, mask=kmask, other=0.0).to(tl.float32)
    a = tl.sum(w1.to(tl.float32) * x[None, :], axis=1)
    b = tl.sum(w2.to(tl.float32) * x[None, :], axis=1)
    if HAS_RMS:
        scale = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        a, b = a * scale, b * scale
    return a, b


@triton.jit
def _gemv_silu_mul_kernel(X, W, Y, K, half, eps, stride_x, stride_y, ROWS: tl.constexpr,
                          BLOCK_N: tl.constexpr, KP: tl.constexpr, HAS_RMS: tl.constexpr,
                          PDL: tl.constexpr, W_POLICY: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, KP)
    kmask = rk < K
    gate = W + rn[:, None].to(tl.int64) * K + rk[None, :]
    wg = _weights(gate, kmask, W_POLICY)
    wu = _weights(gate + half.to(tl.int64) * K, kmask, W_POLICY)
    pdl_enter(PDL)
    for m in tl.static_range(ROWS):
        g, u = _two_products(X + m * stride_x, wg, wu, rk, kmask, K, eps, HAS_RMS)
        tl.store(Y + m * stride_y + rn, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty))


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, rms_eps: float | None = None,
                  pdl: bool | None = None) -> torch.Tensor:
    """silu(gate) * up of x W^T for a fused gate_up W [2 * I, K] -> [rows, I]; with rms_eps, gate
    and up are first scaled by each x row's 1 / rms (the folded norm, as silu_mul's rms_of)."""
    rows, k, pdl = _launch_args(x, w, pdl)
    half = w.shape[0] // 2
    y = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block_n, warps = gemv_config(half, k, 2 * w.element_size())  # NOTE: two slabs a program
    _gemv_silu_mul_kernel[(half // block_n,)](
        x, w, y, k, half, rms_eps or 0.0, x.stride(0), y.stride(0), ROWS=rows, BLOCK_N=block_n,
        KP=triton.next_power_of_2(k), HAS_RMS=rms_eps is not None, PDL=pdl, W_POLICY=_W_POLICY,
        num_warps=warps, launch_pdl=pdl)
    return y


@triton.jit
def _gemv_rotary_store_kernel(X, W, Q, COS, SIN, KV, SLOTS, K, eps, stride_x, stride_qt,
                              stride_qh, stride_c, stride_half, stride_slot, stride_head,
                              NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                              HALF: tl.constexpr, PAIRS: tl.constexpr, KP: tl.constexpr,
                              ROWS: tl.constexpr, HAS_RMS: tl.constexpr, PDL: tl.constexpr,
                              W_POLICY: tl.constexpr):
    # NOTE: a program owns PAIRS rotation pairs of one head: W rows i and i + HALF of it
    pid = tl.program_id(0)
    head = pid * PAIRS // HALF
    i = pid * PAIRS % HALF + tl.arange(0, PAIRS)
    rk = tl.arange(0, KP)
    kmask = rk < K
    lo = W + (head * 2 * HALF + i)[:, None].to(tl.int64) * K + rk[None, :]
    w1 = _weights(lo, kmask, W_POLICY)
    w2 = _weights(lo + HALF * K, kmask, W_POLICY)
    pdl_enter(PDL)
    for m in tl.static_range(ROWS):
        a, b = _two_products(X + m * stride_x, w1, w2, rk, kmask, K, eps, HAS_RMS)
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
                      rms_eps: float | None = None, pdl: bool | None = None) -> torch.Tensor:
    """The fused qkv product of x with W [(heads + 2 * kv_heads) * head_dim, K], then what
    rotary_store_ does with it: returns q [rows, heads, head_dim] rotated; k rotated and v go
    into one layer's cache [2, blocks, block_size, kv_heads, head_dim] at `slots` (negative: not
    written); cos/sin [rows, head_dim // 2] float32. rms_eps: scaled first by x's rows' 1 / rms."""
    rows, k, pdl = _launch_args(x, w, pdl)
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
        num_warps=warps, launch_pdl=pdl)
    return q


@triton.jit
def _gemv_head_norm_kernel(X, W, QKV, COS, SIN, KV, SLOTS, QW, KW, TICKETS, K, eps, qk_eps,
                           stride_c, stride_half, stride_slot, stride_head,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                           HALF: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                           HAS_RMS: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr):
    # NOTE: one row; a program owns BLOCK_N rows of one head; the last of a head's programs
    # to finish (its ticket) norms, rotates and stores the head whole
    rn, rk, kmask, w = _slab(W, K, BLOCK_N, KP, W_POLICY)
    pdl_enter(PDL)
    x = tl.load(X + rk, mask=kmask, other=0.0).to(tl.float32)
    tl.store(QKV + rn, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(QKV.dtype.element_ty))
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
                         pdl: bool | None = None) -> torch.Tensor:
    """One row's fused qkv product with W [(heads + 2 * kv_heads) * head_dim, K], then what
    rotary_store_ does with qk_norm (q weight, k weight, eps) and rms_of x: returns q [1, heads,
    head_dim] normed and rotated; k (normed, rotated) and v go into one layer's cache at the
    slot. tickets: int32 [heads + 2 * kv_heads], zero (zero again after). One launch."""
    rows, k, pdl = _launch_args(x, w, pdl)
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
        launch_pdl=pdl)
    return qkv.view(1, -1, d)[:, :num_heads]
