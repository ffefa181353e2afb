"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope's short
factors) with longrope's attention factor, apply, and a forward's rotation (Rotary, rotary_for)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hsserve.kernels.elementwise import rotary_


def inverse_frequencies(head_dim: int, rope: dict[str, Any]) -> torch.Tensor:
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    powers = base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / powers
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "longrope":  # NOTE: within original_max_position_embeddings (ModelSpec caps it)
        return 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * powers)
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # NOTE: long wavelengths are divided by `factor`, short ones kept, the band between
        # interpolated; the same piecewise rule as the Llama-3.1 reference.
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported; supported: default, linear, llama3, "
                     "longrope")


def attention_factor(rope: dict[str, Any]) -> float:
    """longrope's scale of cos and sin (1 elsewhere). Both q and k carry it, so it is applied as
    its square on the softmax scale: the same scores, no change to the rotary kernels."""
    if rope.get("rope_type") != "longrope":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, original = float(rope["factor"]), float(rope["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dataclass
class Rotary:
    """Each token's rotation, computed once per forward: cos/sin [tokens, head_dim] in the model
    dtype for the torch path; [tokens, head_dim // 2] float32 for the CUDA kernel."""

    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            rotary_(x, self.cos, self.sin)
            return x
        return apply_rotary(x, self.cos, self.sin)


def rotary_for(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
               fused: bool) -> Rotary:
    """The tokens' rotation: in the CUDA kernels' form (fused) or the torch path's."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if fused:  # NOTE: the CUDA kernels' form: float32 [tokens, head_dim // 2]
        return Rotary(freqs.cos(), freqs.sin(), fused=True)
    emb = torch.cat((freqs, freqs), dim=-1)
    return Rotary(emb.cos().to(dtype), emb.sin().to(dtype), fused=False)
