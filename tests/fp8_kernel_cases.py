"""Checks the float8 kernels against their oracles; run on the interpreter and on the GPU.

Every float8 kernel is compared with float64 arithmetic on the dequantized operands (x rounded
to float8 first where asked, by quantize_rows_ref), and the fused GEMVs with the plain kernels
given the dequantized weight (those are checked against torch in kernel_cases.py). on_grid: x's
rows already float8 values times a power of two, so that rounding them is exact: Triton's
interpreter rounds float32 to float8 wrongly just below a power of two (124.3 -> 64), where the
GPU's conversion rounds to nearest as torch does; the GPU runs take x off the grid.
"""

from __future__ import annotations

import torch

from kernel_cases import _close

SCHEMES = [(False, False), (True, False), (True, True)]  # (quantize_inputs, static)
STEP = 2.0**-6  # NOTE: the static input scale, and the grid's spacing factor


def _inputs(m, k, g, device, dtype, on_grid, gain=2.0):
    """x [m, k]: normal values, or (on_grid) float8 values times STEP with each row's amax 448
    (its dynamic scale then STEP too)."""
    x = torch.randn(m, k, generator=g) * gain
    if on_grid:
        x = (x * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        x[:, 0] = 448.0
        x = x * STEP
    return x.to(device, dtype)


def _weights(n, k, g, device):
    """A float8 weight [n, k] and its per-row scales, as models/fp8.quantize makes them."""
    from hsserve.models.fp8 import quantize

    w = torch.randn(n, k, generator=g) / k**0.5
    w8, scale = quantize(w)
    return w8.to(device), scale.to(device)


def _scales(ws, quantize_inputs, static, device):
    from hsserve.kernels.fp8 import Fp8Scales

    inp = torch.tensor([STEP], device=device) if static else None
    return Fp8Scales(ws, quantize_inputs, inp)


def _effective(x, w8, scales):
    """(x, W) in float64 as the kernels compute with them."""
    from hsserve.kernels.fp8 import quantize_rows_ref

    xe = x.double()
    if scales.quantize_inputs:
        q, s = quantize_rows_ref(x, scales.input)
        xe = q.double() * s.double()[:, None]
    return xe, w8.double() * scales.weight.double()[:, None]


def check_quantize_rows(device, dtype, on_grid=False, seed=0):
    """quantize_rows gives quantize_rows_ref's float8 codes and scales exactly: per row (a zero
    row takes the eps scale) and by a static scale (values past 448 clamp)."""
    from hsserve.kernels.fp8 import quantize_rows, quantize_rows_ref

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = _inputs(6, 300, g, device, dtype, on_grid, gain=4.0)
    x[2] = 0
    for scale in (None, torch.tensor([STEP / 2], device=device)):
        q, s = quantize_rows(x, scale)
        rq, rs = quantize_rows_ref(x, scale)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(s, rs)


def check_fp8_gemm(device, dtype, m, n, k, quantize_inputs, static, on_grid=False, seed=0):
    """fp8_gemm equals the float64 product of the dequantized operands, alone, with a bias and
    added into a given output."""
    from hsserve.kernels.fp8 import fp8_gemm, fp8_linear_ref

    g = torch.Generator(device="cpu").manual_seed(seed)
    w8, ws = _weights(n, k, g, device)
    scales = _scales(ws, quantize_inputs, static, device)
    x = _inputs(m, k, g, device, dtype, on_grid)
    bias = torch.randn(n, generator=g).to(device, dtype)
    base = torch.randn(m, n, generator=g).to(device, dtype)
    xe, we = _effective(x, w8, scales)
    ref = xe @ we.T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(fp8_gemm(x, w8, scales), ref, dtype, tol)
    _close(fp8_gemm(x, w8, scales, bias), ref + bias.double(), dtype, tol)
    _close(fp8_gemm(x, w8, scales, into=base.clone()), ref + base.double(), dtype, tol)
    _close(fp8_linear_ref(x, w8, scales), ref, dtype, tol)


def check_fp8_gemv(device, dtype, n, k, quantize_inputs, static, on_grid=False, seed=0):
    """gemv and gemv_silu_mul with a float8 W: the float64 product (added into a given output),
    and silu_mul_ref of it."""
    from hsserve.kernels.elementwise import silu_mul_ref
    from hsserve.kernels.gemv import gemv, gemv_silu_mul

    g = torch.Generator(device="cpu").manual_seed(seed)
    w8, ws = _weights(n, k, g, device)
    scales = _scales(ws, quantize_inputs, static, device)
    x = _inputs(1, k, g, device, dtype, on_grid)
    base = torch.randn(1, n, generator=g).to(device, dtype)
    xe, we = _effective(x, w8, scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(gemv(x, w8, scales=scales), xe @ we.T, dtype, tol)
    _close(gemv(x, w8, into=base.clone(), scales=scales), xe @ we.T + base.double(), dtype, tol)
    _close(gemv_silu_mul(x, w8, scales=scales), silu_mul_ref(xe @ we.T, None, 1e-5), dtype, tol)


def check_fp8_gemv_rotary_store(device, dtype, heads, kv_heads, head_dim, k, quantize_inputs,
                                static, qk_norm, on_grid=False, seed=0):
    """gemv_rotary_store / gemv_head_norm_store with a float8 W write what the plain kernel
    writes given the dequantized weight and x as the kernel rounds it."""
    from hsserve.kernels.gemv import gemv_rotary_store
    from hsserve.kernels.gemv_head_norm import gemv_head_norm_store

    from kernel_cases import _rope

    g = torch.Generator(device="cpu").manual_seed(seed)
    n = (heads + 2 * kv_heads) * head_dim
    w8, ws = _weights(n, k, g, device)
    scales = _scales(ws, quantize_inputs, static, device)
    qw, kw = (1 + 0.3 * torch.randn(2, head_dim, generator=g)).to(device, dtype)
    tickets = torch.zeros(heads + 2 * kv_heads, dtype=torch.int32, device=device)
    x = _inputs(1, k, g, device, dtype, on_grid, gain=3.0)
    xe, we = _effective(x, w8, scales)
    kv = torch.randn(2, 4, 16, kv_heads, head_dim, generator=g).to(device, dtype)
    slots = torch.tensor([17], device=device)
    cos, sin = _rope([700.0], head_dim, device)
    calls = []
    for xx, ww, sc in ((x, w8, scales), (xe.float(), we.float(), None)):
        kvc = kv.clone().to(xx.dtype)
        if qk_norm:
            q = gemv_head_norm_store(xx, ww, heads, kv_heads, cos, sin, kvc, slots,
                                     (qw.to(xx.dtype), kw.to(xx.dtype), 1e-6), tickets, scales=sc)
        else:
            q = gemv_rotary_store(xx, ww, heads, kv_heads, cos, sin, kvc, slots, scales=sc)
        calls.append((q, kvc))
    (q, kvc), (want_q, want_kv) = calls
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(q, want_q, dtype, tol)
    _close(kvc, want_kv, dtype, tol)
    assert tickets.tolist() == [0] * len(tickets)
