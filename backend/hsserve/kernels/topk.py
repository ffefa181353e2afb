"""Each row's k largest logits as log-probabilities (the top alternatives of logprobs), in two
passes like the argmax: pass 1 takes each vocabulary slice's K largest (K extractions of the max
from registers), pass 2 the row's K largest of those candidates. torch's top-k over a 128k-wide
row runs one thread block per row (bench/README.md#logprobs-cost-h200).

Ties go to the lowest token id, in both passes (a slice's candidates are taken in that order).
Reference: topk_logprobs_ref (torch), the oracle of the kernel tests and the path off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SLICE = 2048  # NOTE: vocabulary entries per program of pass 1
_MAX_K = 64  # NOTE: above, torch's top-k (K extractions unrolled would not pay)


@triton.jit
def _slice_topk_kernel(X, VALS, IDX, stride_x, n, num_slices, SLICE: tl.constexpr,
                       K: tl.constexpr):
    r = tl.program_id(0)
    sl = tl.program_id(1)
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
    at = (r * num_slices + sl) * K
    for i in tl.static_range(K):
        best = tl.max(x, 0)
        first = tl.minimum(tl.min(tl.where(x == best, cols, n), 0), n - 1)
        tl.store(VALS + at + i, best)
        tl.store(IDX + at + i, first)
        x = tl.where(cols == first, float("-inf"), x)


@triton.jit
def _merge_topk_kernel(VALS, IDX, LSE, OUT, total, K: tl.constexpr, PAD: tl.constexpr):
    r = tl.program_id(0)
    pos = tl.arange(0, PAD)
    v = tl.load(VALS + r * total + pos, mask=pos < total, other=float("-inf"))
    lse = tl.load(LSE + r)
    for i in tl.static_range(K):
        best = tl.max(v, 0)
        first = tl.min(tl.where(v == best, pos, PAD), 0)  # NOTE: slice order = token order
        first = tl.minimum(first, total - 1)
        token = tl.load(IDX + r * total + first)
        tl.store(OUT + r * 2 * K + i, token.to(tl.float32))
        tl.store(OUT + r * 2 * K + K + i, best - lse)
        v = tl.where(pos == first, float("-inf"), v)


def topk_logprobs_ref(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, 2k] float32: the k most likely token ids (as floats: exact below 2**24) then their
    log-probabilities (logit - lse), most likely first."""
    top = logits.float().topk(k, dim=-1)
    return torch.cat([top.indices.float(), top.values - lse[:, None]], dim=1)


def topk_logprobs(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """As topk_logprobs_ref; the kernels on CUDA for float32 rows, K rounded up to a power of
    two (a few compiled variants, all warmed at start), the first k kept."""
    K = triton.next_power_of_2(k)
    if (logits.device.type != "cuda" or logits.dtype != torch.float32
            or logits.stride(-1) != 1 or K > min(_MAX_K, logits.shape[1])):
        return topk_logprobs_ref(logits, lse, k)
    out = topk_logprobs_triton(logits, lse, K)
    return out if K == k else torch.cat([out[:, :k], out[:, K : K + k]], dim=1)


def topk_logprobs_triton(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    rows, n = logits.shape
    assert logits.stride(-1) == 1 and lse.shape == (rows,) and 0 < k <= n
    num_slices = triton.cdiv(n, _SLICE)
    dev = logits.device
    vals = torch.empty(rows, num_slices * k, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, num_slices * k, dtype=torch.int32, device=dev)
    out = torch.empty(rows, 2 * k, dtype=torch.float32, device=dev)
    if rows:
        _slice_topk_kernel[(rows, num_slices)](logits, vals, idx, logits.stride(0), n,
                                               num_slices, SLICE=_SLICE, K=k)
        _merge_topk_kernel[(rows,)](vals, idx, lse.float().contiguous(), out, num_slices * k, K=k,
                                    PAD=triton.next_power_of_2(num_slices * k))
    return out


def warm_topk(device: torch.device, vocab: int, max_k: int) -> None:
    """Compile every K variant before serving (a first request asking for k must not wait)."""
    x = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    lse = torch.zeros(1, dtype=torch.float32, device=device)
    k = 1
    while k <= min(triton.next_power_of_2(max_k), _MAX_K, vocab):
        topk_logprobs_triton(x, lse, k)
        k *= 2
