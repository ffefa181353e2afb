"""One token's down product (a decode step at batch 1 on CUDA): down over all k slots as a
matrix-vector product, each pair weighed by its routing weight and the pairs summed (and added
into the residual stream) in the same program. Its reference: experts_ref (kernels/moe.py).

At one token the chosen experts are known once the routing is done, before gate_up runs: the
gate_up launch lets this one start only after its own wait for the routing (kernels/pdl.py's
late launch), so a program here reads the experts, then loads its rows of their down weights,
and only then waits for gate_up's h. The down weights stream in while gate_up still runs,
instead of after it (a kernel boundary drains the memory system), and the pairs' sum needs no
launch of its own.

Sums as the grouped path's: each pair's product x its float32 routing weight is rounded to the
model's dtype (the grouped GEMM stores it so), the k pairs summed in float32 in slot order and
cast once (sum_pairs), then added to the stream as into.add_(sum) would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.pdl import pdl_enter

_W_POLICY = "evict_first"  # NOTE: weights stream through L2 once a step (kernels/gemv.py)
_SLAB_BYTES = 32 << 10  # NOTE: weight bytes a program holds (as the GEMV's slabs)
DOWN_CONFIG = (2, 4)  # NOTE: (output rows a program, warps)


def one_token_fits(down: torch.Tensor, k: int) -> bool:
    """down [E, H, I] contiguous, and one output row's k slots within a slab (padded to powers
    of two)."""
    return (down.is_contiguous() and triton.next_power_of_2(k)
            * triton.next_power_of_2(down.shape[2]) * down.element_size() <= _SLAB_BYTES)


@triton.jit
def _down_sum_kernel(H, DOWN, OUT, EXPERTS, WEIGHTS, inter, stride_de, TOPK: tl.constexpr,
                     SP: tl.constexpr, ROWS: tl.constexpr, IP: tl.constexpr,
                     INTO: tl.constexpr, PDL: tl.constexpr, W_POLICY: tl.constexpr):
    rn = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ri = tl.arange(0, IP)
    s = tl.arange(0, SP)  # NOTE: slots padded to a power of two; the padding reads nothing
    real = s < TOPK
    mask = real[:, None] & (ri < inter)[None, :]
    # NOTE: the routing is done when this launch starts (gate_up launches it after its wait);
    # from L2 (.cg): written by another launch
    e = tl.load(EXPERTS + s, mask=real, other=0, cache_modifier=".cg").to(tl.int64)
    w = tl.load(DOWN + e[:, None, None] * stride_de + rn[None, :, None].to(tl.int64) * inter
                + ri[None, None, :], mask=mask[:, None, :], other=0.0, eviction_policy=W_POLICY)
    weight = tl.load(WEIGHTS + s, mask=real, other=0.0, cache_modifier=".cg")
    pdl_enter(PDL)  # NOTE: h is gate_up's
    h = tl.load(H + s[:, None] * inter + ri[None, :], mask=mask, other=0.0).to(tl.float32)
    prod = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)  # NOTE: [SP, ROWS]
    pairs = (prod * weight[:, None]).to(OUT.dtype.element_ty).to(tl.float32)
    acc = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # NOTE: slot order, as sum_pairs
        acc += tl.sum(tl.where(s[:, None] == j, pairs, 0.0), axis=0)
    y = acc.to(OUT.dtype.element_ty)
    if INTO:
        y = (tl.load(OUT + rn).to(tl.float32) + y.to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + rn, y)


def one_token_down(h: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   experts: torch.Tensor, into: torch.Tensor | None = None, pdl: bool = False,
                   config: tuple[int, int] | None = None) -> torch.Tensor:
    """h [k, I] (slot s: silu(gate) * up of the token's expert s), down [E, H, I], weights [1, k]
    float32, experts [1, k] -> [1, H] in h's dtype: sum over slots of weight_s * h_s down_e^T
    (added into `into` in place and returned when given). config: (rows, warps), DOWN_CONFIG."""
    k = experts.shape[-1]
    assert one_token_fits(down, k) and weights.dtype == torch.float32
    assert h.shape == (k, down.shape[2]) and h.is_contiguous() and h.dtype == down.dtype
    hidden, inter = down.shape[1], down.shape[2]
    out = into if into is not None else h.new_empty(1, hidden)
    assert out.is_contiguous() and out.shape == (1, hidden)
    ip, sp = triton.next_power_of_2(inter), triton.next_power_of_2(k)
    rows, warps = config or DOWN_CONFIG
    while rows > 1 and (hidden % rows or rows * sp * ip * h.element_size() > _SLAB_BYTES):
        rows //= 2
    _down_sum_kernel[(hidden // rows,)](
        h, down, out, experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), inter,
        down.stride(0), TOPK=k, SP=sp, ROWS=rows, IP=ip, INTO=into is not None, PDL=pdl,
        W_POLICY=_W_POLICY, num_warps=warps, launch_pdl=pdl)
    return out
