"""Sampler: greedy, temperature, top-k, top-p with per-request seeds.

Noise is a counter-based hash of (seed, output index, token id), so a request's samples depend
only on its own seed and position, never on what else is in the batch, and are the same on any
device (integer arithmetic). Sampling is the Gumbel-max trick: argmax(logits / T + Gumbel).
"""

from __future__ import annotations

import torch

from hsserve.engine.guided import apply_bitmask
from hsserve.kernels.argmax import argmax_rows
from hsserve.request import SamplingParams
from hsserve.engine.transfer import upload

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def sample_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request: the request's own for 0, distinct ones after."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def as_int64(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] uniforms in (0, 1) from int64 seeds [B] and output indices [B]."""
    key = _mix(_mix(seeds * _GOLDEN + steps) + 1)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix(key[:, None] + ids[None, :] * _GOLDEN)
    # NOTE: 23 bits: (2**24 - 0.5) / 2**24 rounds to 1.0 in float32, an infinite Gumbel that
    # picked its token whatever the logits (even a masked one)
    return (_shr(x, 41).float() + 0.5) * (1.0 / (1 << 23))


def banned_tokens(sp: SamplingParams, eos_ids: frozenset[int], output_index: int) -> list[int]:
    """Tokens a sample may not be: before min_tokens, EOS (unless ignored) and the stop ids."""
    if output_index >= sp.min_tokens:
        return []
    return [*sp.stop_token_ids, *(() if sp.ignore_eos else eos_ids)]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], steps: list[int],
    out: torch.Tensor | None = None, banned: list[list[int]] | None = None,
    bitmask: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, vocab] float32 -> token ids [B] (int64, on logits' device), into `out` when
    given (contiguous int64 [B]); banned: per row, tokens masked out first; bitmask: the tokens
    guided decoding allows (engine/guided.py). `logits` itself is left untouched."""
    if banned is not None and any(banned):
        rows = [i for i, ids in enumerate(banned) for _ in ids]
        cols = [t for ids in banned for t in ids]
        logits = logits.index_put((upload(rows, logits.device), upload(cols, logits.device)),
                                  torch.tensor(float("-inf"), device=logits.device))
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    out = argmax_rows(logits, out)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    dev = logits.device
    idx = upload(rows, dev)
    x = logits[idx] / upload([params[i].temperature for i in rows], dev, torch.float32)[:, None]
    top_k = [params[i].top_k for i in rows]
    if any(k > 0 for k in top_k):
        k = upload([k if k > 0 else x.shape[1] for k in top_k], dev)
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = [params[i].top_p for i in rows]
    if any(p < 1.0 for p in top_p):
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each token
        drop = before > upload(top_p, dev, torch.float32)[:, None]
        x = x.scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
    seed_t = upload([as_int64(seeds[i]) for i in rows], dev)
    step_t = upload([steps[i] for i in rows], dev)
    gumbel = -torch.log(-torch.log(uniform_noise(seed_t, step_t, x.shape[1])))
    out[idx] = (x + gumbel).argmax(dim=-1)
    return out
