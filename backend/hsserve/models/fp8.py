"""FP8 weights: the checkpoint's scheme (compressed-tensors' float8, or `quantization: fp8` at
load), refused by field where we would compute it wrongly; quantize, dequantize, and the
activations' quantization as compressed-tensors (transformers' reference) does it.

A weight is float8_e4m3fn W8 [N, K] with one float32 scale per output row (a per-tensor scale is
spread over the rows): W = W8 * scale[:, None]. The CPU dequantizes at load (float32 weights, so
the packed CPU products stay); CUDA keeps W8 and applies the scales in its kernels.
Activations are quantized only where the checkpoint asks: per token (dynamic) or by the
checkpoint's input_scale (static); x is then round-to-fp8(x / s) * s before the product.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # NOTE: torch.finfo(float8_e4m3fn).max
_FIELD = "quantization_config"


@dataclass(frozen=True)
class Fp8Scheme:
    weights: str  # "channel" (a scale per output row) | "tensor" (one per weight)
    activations: str | None  # None (weights only) | "token" (dynamic) | "tensor" (input_scale)
    in_checkpoint: bool  # the checkpoint holds float8 weights (else: quantized at load)
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) left unquantized

    def ignores(self, module: str) -> bool:
        """compressed-tensors' matching: "re:" patterns by re.match, else the exact name."""
        return any(re.match(t[3:], module) if t.startswith("re:") else t == module
                   for t in self.ignore)


# NOTE: `quantization` at load: fp8 weights only; fp8_dynamic also rounds each token's inputs
# (FP8 tensor cores), the arithmetic of the public *-FP8-dynamic checkpoints
AT_LOAD = {"fp8": Fp8Scheme(weights="channel", activations=None, in_checkpoint=False),
           "fp8_dynamic": Fp8Scheme(weights="channel", activations="token", in_checkpoint=False)}
QUANTIZATIONS = ("none", *AT_LOAD)


def _refuse(path: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_FIELD}.{path}: {value!r} is not supported; supported: {allowed}")


def _check(args: dict[str, Any], path: str, strategies: dict[bool, tuple[str, ...]]) -> str:
    """One QuantizationArgs of a group: float8, symmetric, no groups or blocks -> its strategy."""
    for key, want in (("num_bits", 8), ("type", "float"), ("symmetric", True)):
        if args.get(key, want) != want:
            raise _refuse(f"{path}.{key}", args.get(key), repr(want))
    for key in ("group_size", "block_structure", "actorder"):
        if args.get(key) is not None:
            raise _refuse(f"{path}.{key}", args[key], "null (float8 per channel or tensor)")
    dynamic = bool(args.get("dynamic", False))
    allowed = strategies.get(dynamic, ())
    if not allowed:
        raise _refuse(f"{path}.dynamic", args.get("dynamic"), repr(not dynamic))
    strategy = args.get("strategy", "tensor")
    if strategy not in allowed:
        raise _refuse(f"{path}.strategy", strategy, ", ".join(map(repr, allowed)))
    return strategy


def parse_scheme(cfg: dict[str, Any] | None) -> Fp8Scheme | None:
    """A config.json's quantization_config -> the scheme (None: not quantized); anything but
    compressed-tensors' float8 weights is a ValueError naming the field."""
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method != "compressed-tensors":
        raise _refuse("quant_method", method, "'compressed-tensors' (float8 weights)")
    fmt = cfg.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse("format", fmt, "'float-quantized', 'naive-quantized'")
    if cfg.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme", cfg["kv_cache_scheme"], "null (a bf16 KV cache)")
    groups = cfg.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one group")
    (name, group), = groups.items()
    path = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{path}.targets", group.get("targets"), "['Linear']")
    if group.get("output_activations"):
        raise _refuse(f"{path}.output_activations", group["output_activations"], "null")
    if not group.get("weights"):
        raise _refuse(f"{path}.weights", group.get("weights"), "float8 weights")
    weights = _check(group["weights"], f"{path}.weights", {False: ("channel", "tensor")})
    acts = group.get("input_activations")
    activations = None if not acts else _check(
        acts, f"{path}.input_activations", {True: ("token",), False: ("tensor",)})
    return Fp8Scheme(weights=weights, activations=activations, in_checkpoint=True,
                     ignore=tuple(cfg.get("ignore") or ()))


def scheme_for(folder: str, quantization: str) -> Fp8Scheme | None:
    """The folder's float8 scheme (its config.json's quantization_config), else AT_LOAD's for
    `quantization`, else None (bf16 / float32 weights)."""
    with open(os.path.join(folder, "config.json")) as f:
        scheme = parse_scheme(json.load(f).get(_FIELD))
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {quantization!r}; allowed: {', '.join(QUANTIZATIONS)}")
    return scheme or AT_LOAD.get(quantization)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale ([rows, 1], [rows], [1] or []) -> [rows], its dtype kept."""
    flat = scale.reshape(-1)
    return flat.expand(rows).clone() if flat.numel() == 1 else flat.reshape(rows)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (W8 [N, K], float32 scales [N]): a scale per output row, amax / 448, as
    compressed-tensors' channel observer (zero rows: its eps)."""
    w = w.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 [N, K] with scales [N] -> W in dtype; the product in the scale's dtype, as
    compressed-tensors' decompression (a bfloat16 scale rounds it there)."""
    return (w8.to(scale.dtype) * scale[:, None]).to(dtype)


def quantize_input(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] rounded to float8 and back: by `scale` (static, [1]), or each row by its own
    amax / 448 (dynamic per token), as compressed-tensors' forward does (the reference)."""
    if scale is None:
        scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.to(scale.dtype) * scale).to(x.dtype)
