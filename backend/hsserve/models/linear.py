"""Linear: y = x W^T (+ b), with weights packed once for the CPU's product.

On the CPU (float32) the product is our compiled one (kernels/cpu/gemm.cpp) where its library
builds: 1.4-2x oneDNN's packed linear at 1-8 rows and ~1.2x at 32, and on par for prefill
(bench/README.md#cpu-compiled-gemm); each row's bits are the same whatever the batch. Where the
library cannot be built, torch's: x86's fp32 GEMM goes through MKL, which runs small-M products
(decode batches) far below the core's FMA rate; oneDNN's packed-weight linear (the op torch's own
compiler uses for frozen CPU graphs) is faster at M = 2..32 (bench/README.md#cpu-mkl-packed-linears).
Either packed copy replaces the dense weight; the torch fallback (F.linear) is used elsewhere and
as the oracle. Without the library, one row (batch-1 decode) is a matrix-vector product, where
MKL's GEMV is the faster one on Intel CPUs and the slower one on AMD (where MKL takes generic
paths): on Intel, for models whose linears are small enough to hold twice, the dense weight stays
for one-row inputs. Decided by the CPU's vendor, never by timing, so that every process on a
machine computes the same bits (the server's engine and a client's reference engine are compared
exactly in the tests). MKL also packs a weight for one row count (at 32 rows on Intel faster than
oneDNN's; any other row count falls back to the dense product), so on Intel, for small models
(its packed copy takes 2-9x the weight), 17-32-row inputs are padded to 32 rows and take it.
On CUDA a few rows (decode at small batch) go through our GEMV kernel (kernels/gemv.py), which
beats cuBLAS there; more rows through cuBLAS.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hsserve.kernels import cpu_ops
from hsserve.kernels.fp8 import Fp8Scales, fp8_gemm, fp8_linear_ref
from hsserve.kernels.gemv import gemv, gemv_fits
from hsserve.models.fp8 import FP8, FP8_MAX, quantize_input

_PACK_BATCH_HINT = 32  # NOTE: best across M = 1..2048 (bench/README.md#cpu-mkl-packed-linears)
# NOTE: the dense copy doubles the linears' memory: kept only up to this many bytes of them
_KEEP_DENSE_MAX_BYTES = 2 << 30
# NOTE: MKL's packed weight serves inputs of _MKL_MIN_ROWS.._MKL_ROWS rows (padded to _MKL_ROWS),
# only for models whose linears take at most _MKL_PACK_MAX_BYTES (the copies take 2-9x the weights)
_MKL_ROWS = 32
_MKL_MIN_ROWS = 17
_MKL_PACK_MAX_BYTES = 1 << 30


def _packing_available() -> bool:
    dnnl = torch.ops.mkldnn
    return hasattr(dnnl, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def _mkl_packing_available() -> bool:
    mkl = torch.ops.mkl
    return hasattr(mkl, "_mkl_reorder_linear_weight") and torch.backends.mkl.is_available()


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 fp8: bool = False):
        """fp8: the weight is float8 W8 with a float32 scale per output row (models/fp8.py),
        both kept (CUDA); the CPU holds dequantized weights."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features,
                                               dtype=FP8 if fp8 else None), requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32)
                             if fp8 else None, persistent=False)
        # NOTE: the checkpoint quantizes the inputs: per token, or by input_scale ([1], static)
        self.quantize_inputs = False
        self.input_scale: torch.Tensor | None = None
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.mkl_packed: torch.Tensor | None = None  # NOTE: MKL's, for _MKL_ROWS rows
        self.compiled: torch.Tensor | None = None  # NOTE: gemm.cpp's packed weight, its N below
        self.compiled_rows = 0
        # NOTE: row-parallel (tensor parallelism): sums a rank's partial product over the ranks
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # NOTE: and, for inputs quantized per token, takes each row's amax over the ranks
        self.reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b); with `into`, added to it in place and returned (on CUDA by the GEMM
        itself: an out-of-place add would cost a copy kernel)."""
        if self.reduce is not None:  # NOTE: the whole product first, then the add
            rounded = self.quantize_inputs and self.input_scale is None
            if rounded:
                x = self._round_whole_rows(x)
            y = self.reduce(self._product(x, rounded=rounded))
            return y if into is None else into.add_(y)
        return self._product(x, into)

    def _product(self, x: torch.Tensor, into: torch.Tensor | None = None,
                 rounded: bool = False) -> torch.Tensor:
        """rounded: x is rounded to float8 already (no input quantization here)."""
        if self.weight_scale is not None:
            return self._fp8_product(x, into, rounded)
        if self.quantize_inputs and not rounded:  # NOTE: the reference's rounding (CPU)
            x = quantize_input(x, self.input_scale)
        if self.compiled is not None:
            y = cpu_ops.gemm(x, self.compiled, self.compiled_rows, self.bias)
            return y if into is None else into.add_(y)
        if self.mkl_packed is not None and _MKL_MIN_ROWS <= x.numel() // x.shape[-1] <= _MKL_ROWS:
            y = self._mkl_rows(x)
            return y if into is None else into.add_(y)
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

    @torch.no_grad()
    def fold_norm(self, weight: torch.Tensor) -> None:
        """The norm before (its weight [in_features]) multiplied into the columns
        (Decoder.fold_norms)."""
        w = self.weight
        w.copy_((w.float() * weight.float()[None, :]).to(w.dtype))

    def _fp8_product(self, x: torch.Tensor, into: torch.Tensor | None,
                     rounded: bool = False) -> torch.Tensor:
        """The float8 weight's product: one row by the GEMV, more by fp8_gemm (the reference off
        CUDA)."""
        scales, w = self.fp8_scales(), self.weight
        if rounded:
            scales = Fp8Scales(scales.weight)
        x2 = x.reshape(-1, x.shape[-1])
        into2 = into.view(-1, w.shape[0]) if into is not None else None
        if not x.is_cuda:
            y = fp8_linear_ref(x2, w, scales, self.bias)
            y = y if into2 is None else into2.add_(y)
        elif self.takes_gemv(x2):
            y = gemv(x2, w, into2, scales=scales)
        else:
            y = fp8_gemm(x2, w, scales, self.bias, into2)
        return y.view(*x.shape[:-1], w.shape[0])

    def _round_whole_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's share of x rounded to float8 by the whole row's amax (the
        ranks' largest), as one engine would; the product then takes x as it is."""
        amax = self.reduce_max(x.abs().amax(dim=-1, keepdim=True).contiguous())
        scale = torch.where(amax == 0, torch.finfo(amax.dtype).eps, amax / FP8_MAX)
        return quantize_input(x, scale)

    def fp8_scales(self) -> Fp8Scales | None:
        """The scales the FP8 kernels apply (None: not a float8 weight)."""
        if self.weight_scale is None:
            return None
        return Fp8Scales(self.weight_scale, self.quantize_inputs, self.input_scale)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether x W^T goes through our GEMV kernel (no bias; see gemv_fits); the fused
        GEMV-and-epilogue kernels of the decoder ask the same."""
        return self.bias is None and gemv_fits(x, self.weight)

    def _mkl_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (+ b) through MKL's packed weight: x's rows padded with zeros to _MKL_ROWS."""
        x2 = x.reshape(-1, x.shape[-1])
        rows = len(x2)
        if rows < _MKL_ROWS:
            x2 = torch.cat((x2, x2.new_zeros(_MKL_ROWS - rows, x2.shape[1])))
        y = torch.ops.mkl._mkl_linear(x2, self.mkl_packed, self.weight, self.bias, _MKL_ROWS)
        return y[:rows].view(*x.shape[:-1], y.shape[-1])

    def pack(self, keep_dense: bool = False, mkl_rows: bool = False, compiled: bool = False) -> None:
        """With compiled, replace the weight (CPU, float32) by gemm.cpp's packed copy, used for
        every input. Else add a oneDNN-packed copy, used for inputs of more than one row, or for
        all of them once the dense weight is dropped (keep_dense False); with mkl_rows (which
        keeps the dense weight: MKL's product needs it), also MKL's packed copy, used for
        _MKL_MIN_ROWS.._MKL_ROWS rows."""
        w = self.weight.detach()
        if compiled:
            self.compiled, self.compiled_rows = cpu_ops.pack_weight(w), w.shape[0]
            self.weight = None
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        if mkl_rows:
            self.mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, _MKL_ROWS)
        elif not keep_dense:
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


def pack_for_cpu(model: nn.Module, keep_dense: bool | None = None,
                 mkl_rows: bool | None = None, compiled: bool | None = None) -> bool:
    """Pack every Linear of a float32 CPU model: for the compiled product where `compiled`
    (None: where its library loads), else for oneDNN, keeping the dense weights for one-row
    inputs when keep_dense (None: where mkl_gemv_preferred and all the linears take at most
    _KEEP_DENSE_MAX_BYTES); with mkl_rows also MKL's packed weights for 17-32 rows, which need
    the dense ones (None: where the dense weights are kept and the linears take at most
    _MKL_PACK_MAX_BYTES). False (nothing done) where packing does not apply."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight is not None]
    if compiled is None:
        compiled = cpu_ops.library() is not None
    if compiled:
        for m in linears:
            m.pack(compiled=True)
        return True
    if not _packing_available():
        return False
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    intel = mkl_gemv_preferred()  # NOTE: read once (both defaults ask it)
    if keep_dense is None:
        keep_dense = size <= _KEEP_DENSE_MAX_BYTES and intel
    if mkl_rows is None:
        mkl_rows = keep_dense and size <= _MKL_PACK_MAX_BYTES and intel
    mkl_rows = mkl_rows and _mkl_packing_available()
    for m in linears:
        m.pack(keep_dense=keep_dense, mkl_rows=mkl_rows)
    return True
