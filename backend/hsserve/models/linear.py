"""Linear: y = x W^T (+ b), with weights prepacked for oneDNN on the CPU.

On x86 CPUs torch's default fp32 GEMM goes through MKL, which runs small-M products (decode
batches) far below the core's FMA rate; oneDNN's packed-weight linear (the op torch's own
compiler uses for frozen CPU graphs) measured 1.6-2x faster at M = 2..32 on AMD and Intel 2-core
machines. The packed copy replaces the dense weight; the torch fallback (F.linear) is used
elsewhere and as the oracle. One row (batch-1 decode) is a matrix-vector product, where MKL's
GEMV is the faster one on Intel CPUs (2-core Xeon, AVX-512: 20-40% on the default model's layer
shapes) and the slower one on AMD (where MKL takes generic paths): on Intel, for models whose
linears are small enough to hold twice, the dense weight stays for one-row inputs. Decided by
the CPU's vendor, never by timing, so that every process on a machine computes the same bits
(the server's engine and a client's reference engine are compared exactly in the tests).
On CUDA a few rows (decode at small batch) go through our GEMV kernel (kernels/gemv.py), which
beats cuBLAS there; more rows through cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hsserve.kernels.gemv import gemv, gemv_fits

_PACK_BATCH_HINT = 32  # NOTE: measured best across M = 1..2048 on a 2-core AVX2 machine
# NOTE: the dense copy doubles the linears' memory: kept only up to this many bytes of them
_KEEP_DENSE_MAX_BYTES = 2 << 30


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
        if self.packed is not None and (self.weight is None or x.numel() != x.shape[-1]):
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

    def pack(self, keep_dense: bool = False) -> None:
        """Add a oneDNN-packed copy of the weight (CPU, float32), used for inputs of more than one
        row, or for all of them once the dense weight is dropped (keep_dense False)."""
        w = self.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        if not keep_dense:
            self.weight = None


def mkl_gemv_preferred() -> bool:
    """Whether one-row products go through MKL (F.linear) rather than the packed weight: on an
    Intel CPU (its vendor in /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


def pack_for_cpu(model: nn.Module, keep_dense: bool | None = None) -> bool:
    """Pack every Linear of a float32 CPU model, and keep the dense weights for one-row inputs
    when keep_dense (None: where mkl_gemv_preferred and all the linears take at most
    _KEEP_DENSE_MAX_BYTES); False (nothing done) where packing does not apply."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32 or not _packing_available():
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight is not None]
    if keep_dense is None:
        size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        keep_dense = size <= _KEEP_DENSE_MAX_BYTES and mkl_gemv_preferred()
    for m in linears:
        m.pack(keep_dense=keep_dense)
    return True
