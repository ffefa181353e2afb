"""Provides FP8 copies of HF folders in compressed-tensors' float8 layout, for the FP8 tests.

The layout is llm-compressor's; the copies are written without our package so that they test
our loader, not echo it."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_KEEP = ("lm_head.weight", "mlp.gate.weight")  # NOTE: left unquantized (llm-compressor's ignore)


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight") and not name.endswith(_KEEP)


def _weight_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' minmax observer for float8: scale = amax / 448 (per row or tensor)."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
    scale = torch.clamp(amax / 448.0, min=torch.finfo(torch.float32).eps)
    w8 = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return w8, scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)


def write_fp8_copy(src: str, dst: str, weights: str = "channel", activations: str | None = None,
                   input_scale: float = 0.02, extra: dict | None = None) -> str:
    """dst: src's model with every *_proj linear in float8 (weights: "channel" | "tensor";
    activations None | "token" (dynamic) | "tensor" (static, `input_scale` for every linear)),
    its config.json carrying the quantization_config (updated by `extra`)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith((".safetensors", ".bin", ".index.json")):
            p = os.path.join(src, f)
            if os.path.isfile(p):
                shutil.copy(p, os.path.join(dst, f))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), framework="pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _quantized(name, t):
            out[name] = t.contiguous()
            continue
        out[name], out[name + "_scale"] = _weight_fp8(t, weights)
        if activations == "tensor":
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor([input_scale])
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    acts = None
    if activations == "token":
        acts = {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True,
                "type": "float"}
    elif activations == "tensor":
        acts = {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True,
                "type": "float", "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "kv_cache_scheme": None,
          "config_groups": {"group_0": {
              "targets": ["Linear"], "input_activations": acts, "output_activations": None,
              "weights": {"dynamic": False, "num_bits": 8, "strategy": weights,
                          "symmetric": True, "type": "float", "observer": "minmax"}}}}
    qc.update(extra or {})
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return dst
