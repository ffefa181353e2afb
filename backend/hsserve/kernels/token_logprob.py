"""Per row of the logits: a chosen token's log-probability, its rank and the row's logsumexp, in
one pass over the vocabulary (an online max / sum of exponentials and a count of the logits
above the chosen one) and one launch, instead of a log-softmax written and read again.

Reference: token_logprob_ref (torch), the oracle of the kernel tests and the path off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # NOTE: vocabulary entries per loop step of a row's program


@triton.jit
def _token_logprob_kernel(X, TOK, OUT, stride_x, n, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    picked = tl.load(X + r * stride_x + tl.load(TOK + r))
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    above = tl.zeros([], tl.int32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # NOTE: -inf - -inf would be NaN
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), 0)
        m = m_new
        above += tl.sum((x > picked).to(tl.int32), 0)
    lse = m + tl.log(s)
    tl.store(OUT + r * 3, picked - lse)
    tl.store(OUT + r * 3 + 1, (above + 1).to(tl.float32))
    tl.store(OUT + r * 3 + 2, lse)


def token_logprob_ref(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows, 3] float32: (log-probability of tokens[r], its rank (1 = the most likely),
    logsumexp of the row)."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, tokens[:, None])[:, 0]
    rank = (x > picked[:, None]).sum(dim=1) + 1
    return torch.stack([picked - lse, rank.float(), lse], dim=1)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """As token_logprob_ref; the kernel on CUDA for float32 rows."""
    if logits.device.type != "cuda" or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        return token_logprob_ref(logits, tokens)
    return token_logprob_triton(logits, tokens)


def token_logprob_triton(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    rows, n = logits.shape
    assert tokens.shape == (rows,) and logits.stride(-1) == 1
    out = torch.empty(rows, 3, dtype=torch.float32, device=logits.device)
    if rows:
        _token_logprob_kernel[(rows,)](logits, tokens.contiguous(), out, logits.stride(0), n,
                                       BLOCK=_BLOCK)
    return out
