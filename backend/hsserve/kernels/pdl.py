"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
kernel before it finishes. Each of our decode kernels lets the next one launch at once and
waits (griddepcontrol.wait) before it touches anything the previous kernel wrote; what does not
depend on it (the GEMV's weights) is loaded before the wait, so kernel boundaries stop draining
the memory system. A kernel without the attribute (cuBLAS, torch ops) waits as usual."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


_MAX_ROWS = 1  # NOTE: the step's row count; above it PDL gains nothing (bench/README.md#gemv-slabs-and-pdl)


def pdl_on(t: torch.Tensor) -> bool:
    """Whether the kernel over t's rows launches with PDL: CUDA, sm_90+, a decode step of at most
    _MAX_ROWS rows (t's first dimension); never under Triton's interpreter (no inline PTX)."""
    return (t.is_cuda and len(t) <= _MAX_ROWS and not triton.knobs.runtime.interpret
            and _supported(t.device.index or 0))


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one to be done and visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
