"""Guided decoding's token mask on the GPU: logits where a row's bitmask allows, else -inf.

One program per (row, slice of the vocabulary) reads the slice's bitmask words. The result goes
to a workspace kept per device (grown, never shrunk), so that a guided step allocates no
vocabulary-sized tensors (the torch reference makes four). Reference: bitmask_ref (the CPU and
test oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_workspace: dict[torch.device, torch.Tensor] = {}


def bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with the tokens int32 bitmask [rows, words] forbids at -inf."""
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> bits) & 1).reshape(len(bitmask), -1)
    return logits.masked_fill(allowed[:, : logits.shape[1]] == 0, float("-inf"))


@triton.jit
def _mask_kernel(L, B, O, V, W, stride_l, BLOCK: tl.constexpr):
    r, s = tl.program_id(0), tl.program_id(1)
    v = s * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    word = tl.load(B + r * W + v // 32, mask=inside, other=0)
    keep = ((word >> (v % 32)) & 1) != 0
    x = tl.load(L + r.to(tl.int64) * stride_l + v, mask=inside, other=0.0)
    tl.store(O + r.to(tl.int64) * V + v, tl.where(keep, x, float("-inf")), mask=inside)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """As bitmask_ref, into the device's workspace (valid until the next call: the step's
    sampling reads it, queued before the next step's masking)."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.is_contiguous()
    buf = _workspace.get(logits.device)
    if buf is None or buf.numel() < rows * vocab:
        buf = _workspace[logits.device] = torch.empty(rows * vocab, dtype=torch.float32,
                                                      device=logits.device)
    out = buf[: rows * vocab].view(rows, vocab)
    if rows:
        _mask_kernel[(rows, triton.cdiv(vocab, _BLOCK))](logits, bitmask, out, vocab,
                                                         bitmask.shape[1], logits.stride(0),
                                                         BLOCK=_BLOCK)
    return out
