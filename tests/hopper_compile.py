"""Compiles every launch variant of the GEMV and float8 kernels for sm_90 without a GPU.

Run as a script in a process of its own (the suite's process runs Triton's interpreter, whose
functions do not compile): `python tests/hopper_compile.py` prints a line per variant that fails
and exits 1 (tests/kernels/test_kernels_compile_for_hopper.py runs it).

A stand-in driver names an sm_90 target and each launch is compiled (JITFunction's warm-up),
not run: the outputs are not looked at here (fp8_kernel_cases.py checks them).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver, jit

F8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


class _Hopper(DriverBase):
    """Just enough of a CUDA driver for Triton to compile: the target and a device / stream."""

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None

    def map_python_to_cpp_type(self, ty):
        return ty


def compile_only() -> None:
    """From here on a kernel launch compiles for sm_90 and returns without running."""
    assert os.environ.get("TRITON_INTERPRET", "0") == "0"
    run = jit.JITFunction.run

    def warm_up(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    jit.JITFunction.run = warm_up
    driver.set_active(_Hopper())


def _scales(n, quant):
    """quant: None (a plain weight), "weights", "token" (x per row), "static"."""
    from hsserve.kernels.fp8 import Fp8Scales

    if quant is None:
        return None
    return Fp8Scales(torch.ones(n), quant != "weights", torch.ones(1) if quant == "static" else None)


def gemvs(quant, pdl):
    from hsserve.kernels.gemv import gemv, gemv_silu_mul

    k, n = 512, 1024
    x = torch.zeros(1, k, dtype=BF16)
    w = torch.zeros(n, k, dtype=F8 if quant else BF16)
    sc = _scales(n, quant)
    gemv(x, w, pdl=pdl, scales=sc)
    gemv(x, w, into=torch.zeros(1, n, dtype=BF16), pdl=pdl, scales=sc)
    gemv_silu_mul(x, w, pdl=pdl, scales=sc)
    if quant in (None, "weights"):
        gemv_silu_mul(x, w, rms_eps=1e-6, pdl=pdl, scales=sc)
    if quant is None:
        gemv(x, w, pdl=pdl, norm=(torch.ones(k, dtype=BF16), 1e-6))


def fused_qkv(quant, qk_norm):
    from hsserve.kernels.gemv import gemv_rotary_store
    from hsserve.kernels.gemv_head_norm import gemv_head_norm_store

    heads, kv_heads, d, k = 4, 2, 128, 1024
    n = (heads + 2 * kv_heads) * d
    x = torch.zeros(1, k, dtype=BF16)
    w = torch.zeros(n, k, dtype=F8 if quant else BF16)
    kv = torch.zeros(2, 4, 16, kv_heads, d, dtype=BF16)
    cos = sin = torch.zeros(1, d // 2)
    slots = torch.zeros(1, dtype=torch.int64)
    rms = 1e-6 if quant in (None, "weights") else None
    if qk_norm:
        norms = (torch.ones(d, dtype=BF16), torch.ones(d, dtype=BF16), 1e-6)
        gemv_head_norm_store(x, w, heads, kv_heads, cos, sin, kv, slots, norms,
                             torch.zeros(n // d, dtype=torch.int32), rms_eps=rms, pdl=True,
                             scales=_scales(n, quant))
    else:
        gemv_rotary_store(x, w, heads, kv_heads, cos, sin, kv, slots, rms_eps=rms, pdl=True,
                          scales=_scales(n, quant))


def gemm(quant, m):
    from hsserve.kernels.fp8 import fp8_gemm, quantize_rows

    k, n = 256, 512
    x = torch.zeros(m, k, dtype=BF16)
    w = torch.zeros(n, k, dtype=F8)
    sc = _scales(n, quant)
    fp8_gemm(x, w, sc)
    fp8_gemm(x, w, sc, bias=torch.zeros(n, dtype=BF16), into=torch.zeros(m, n, dtype=BF16))
    quantize_rows(x, sc.input)


def swapped_gemm(splits):
    import hsserve.kernels.fp8 as fp8

    default, fp8.swap_config = fp8.swap_config, lambda *_a: (128, 16, 128, splits, 4, 3)
    try:
        gemm("weights", 16)
    finally:
        fp8.swap_config = default


QUANTS = (None, "weights", "token", "static")
VARIANTS = {
    **{f"gemvs quant={q} pdl={p}": (gemvs, q, p) for q in QUANTS for p in (False, True)},
    **{f"fused qkv quant={q} qk_norm={n}": (fused_qkv, q, n) for q in QUANTS for n in (False, True)},
    **{f"fp8 gemm quant={q} rows={m}": (gemm, q, m)
       for q in QUANTS[1:] for m in (4, 40, 300, 600)},  # NOTE: 600: the widened weight's kernel
    **{f"fp8 swapped gemm splits={s}": (swapped_gemm, s) for s in (1, 2)},
}


def main() -> int:
    compile_only()
    failed = 0
    for name, (fn, *args) in VARIANTS.items():
        try:
            fn(*args)
        except Exception:  # NOTE: every variant tried; the first lines say where it broke
            failed += 1
            print(f"FAIL {name}:\n{traceback.format_exc(limit=-3)}", flush=True)
    print(f"{len(VARIANTS) - failed} of {len(VARIANTS)} variants compile for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
