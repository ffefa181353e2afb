"""Linear: y = x W^T (+ b), with weights prepacked for oneDNN on the CPU.

On x86 CPUs torch's default fp32 GEMM goes through MKL, which runs small-M products (decode
batches) far below the core's FMA rate; oneDNN's packed-weight linear (the op torch's own
compiler uses for frozen CPU graphs) measured 1.6-2x faster here at M = 1..32. The packed copy
replaces the dense weight; the torch fallback (F.linear) is used elsewhere and as the oracle.
On CUDA a few rows (decode at small batch) go through our GEMV kernel (kernels/gemv.py), which
beats cuBLAS there; more rows through cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hsserve.kernels.gemv import gemv, gemv_fits

_PACK_BATCH_HINT = 32  # NOTE: measured best across M = 1..2048 on a 2-core AVX2 machine


def _packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b); with `into`, added to it in place and returned (on CUDA by the GEMM
        itself: an out-of-place add would cost a copy kernel)."""
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y if into is None else into.add_(y)
        if self.takes_gemv(x):
            return gemv(x, self.weight, into)
        if into is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None and x.dim() == 2:
            return into.addmm_(x, self.weight.t())
        return into.add_(F.linear(x, self.weight, self.bias))

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether x W^T goes through our GEMV kernel (no bias; see gemv_fits); the fused
        GEMV-and-epilogue kernels of the decoder ask the same."""
        return self.bias is None and gemv_fits(x, self.weight)

    def pack(self, weight: torch.Tensor | None = None) -> None:
        """Replace the dense weight by a oneDNN-packed copy (CPU, float32)."""
        w = self.weight if weight is None else weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        self.weight = None


def pack_for_cpu(model: nn.Module) -> bool:
    """Pack every Linear of a float32 CPU model; False (nothing done) where not applicable."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32 or not _packing_available():
        return False
    for m in model.modules():
        if isinstance(m, Linear) and m.weight is not None:
            m.pack()
    return True
