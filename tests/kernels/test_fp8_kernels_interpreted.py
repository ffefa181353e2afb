"""Proves the float8 kernels match their float64 oracles on the CPU, through Triton's interpreter.

x on the float8 grid here (fp8_kernel_cases.py says why); the GPU run of the same checks, with
x off it, is tests/gpu/test_gpu_fp8.py."""

from __future__ import annotations

import os

import pytest
import torch

from fp8_kernel_cases import (SCHEMES, check_fp8_gemm, check_fp8_gemv,
                              check_fp8_gemv_rotary_store, check_quantize_rows)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter run is for CPU-only machines",
)


def test_quantize_rows_matches_reference():
    check_quantize_rows("cpu", torch.float32, on_grid=True)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
@pytest.mark.parametrize("m, n, k", [(3, 70, 200), (40, 64, 96), (600, 40, 96)])
def test_fp8_gemm_matches_float64(m, n, k, quantize_inputs, static):
    check_fp8_gemm("cpu", torch.float32, m, n, k, quantize_inputs, static, on_grid=True)


@pytest.mark.parametrize("cfg", [(32, 16, 32, 1, 4, 3), (64, 32, 64, 3, 4, 3)])
@pytest.mark.parametrize("m, n, k", [(3, 70, 200), (40, 64, 96)])
def test_fp8_swapped_gemm_matches_float64(m, n, k, cfg, monkeypatch):
    import hsserve.kernels.fp8 as fp8

    monkeypatch.setattr(fp8, "swap_config", lambda *_a: cfg)  # NOTE: K split 1 and 3 ways
    check_fp8_gemm("cpu", torch.float32, m, n, k, False, False, on_grid=True)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
def test_fp8_gemv_matches_float64(quantize_inputs, static):
    check_fp8_gemv("cpu", torch.float32, 96, 200, quantize_inputs, static, on_grid=True)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fp8_gemv_rotary_store_matches_plain_kernel(quantize_inputs, static, qk_norm):
    check_fp8_gemv_rotary_store("cpu", torch.float32, 4, 2, 64, 1024, quantize_inputs, static,
                                qk_norm, on_grid=True)
