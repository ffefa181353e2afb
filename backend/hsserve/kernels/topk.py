"""Each row's k largest logits as log-probabilities (the top alternatives of logprobs). A row's
K largest lie in the K slices of the vocabulary whose maxima are largest (a slice holding one
of them has at most K - 1 slices above it), so: pass 1 takes each slice's max, pass 2 (K
programs a row) finds the row's j-th best slice and extracts that slice's K largest, pass 3
merges those K * K candidates. torch's top-k over a 128k-wide row runs one thread block per row
(bench/README.md#logprobs-cost-h200).

Order: by value, ties to the lowest token id (slices by max, ties to the lowest slice).
Reference: topk_logprobs_ref (torch), the oracle of the kernel tests and the path off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SLICE = 2048  # NOTE: vocabulary entries per slice
_MAX_K = 64  # NOTE: above, torch's top-k (K extractions unrolled would not pay)


@triton.jit
def _slice_max_kernel(X, SMAX, stride_x, n, num_slices, SLICE: tl.constexpr):
    r = tl.program_id(0)
    sl = tl.program_id(1)
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
    tl.store(SMAX + r * num_slices + sl, tl.max(x, 0))


@triton.jit
def _slice_topk_kernel(X, SMAX, VALS, IDX, stride_x, n, num_slices, SLICE: tl.constexpr,
                       K: tl.constexpr, PAD: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.arange(0, PAD)
    m = tl.load(SMAX + r * num_slices + s, mask=s < num_slices, other=float("-inf"))
    sl = 0
    for i in tl.static_range(K):  # NOTE: the row's j-th slice by max
        best = tl.max(m, 0)
        first = tl.min(tl.where(m == best, s, PAD), 0)
        sl = tl.where(i == j, first, sl)
        m = tl.where(s == first, float("-inf"), m)
    # NOTE: j past the row's slices picks a slice again: its candidates merge away as duplicates
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
    at = (r * K + j) * K
    for i in tl.static_range(K):
        best = tl.max(x, 0)
        first = tl.minimum(tl.min(tl.where(x == best, cols, n), 0), n - 1)
        tl.store(VALS + at + i, best)
        tl.store(IDX + at + i, first)
        x = tl.where(cols == first, float("-inf"), x)


@triton.jit
def _merge_topk_kernel(VALS, IDX, LSE, OUT, K: tl.constexpr):
    r = tl.program_id(0)
    pos = tl.arange(0, K * K)
    v = tl.load(VALS + r * K * K + pos)
    ids = tl.load(IDX + r * K * K + pos)
    lse = tl.load(LSE + r)
    for i in tl.static_range(K):
        best = tl.max(v, 0)
        token = tl.min(tl.where(v == best, ids, 2147483647), 0)  # NOTE: ties: the lowest id
        tl.store(OUT + r * 2 * K + i, token)
        tl.store(OUT + r * 2 * K + K + i, (best - lse).to(tl.int32, bitcast=True))
        v = tl.where((v == best) & (ids == token), float("-inf"), v)  # NOTE: and its duplicates


def topk_logprobs_ref(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """Packed int32 [rows, 2k]: the k most likely token ids, most likely first, then their
    log-probabilities (logit - lse; float32 bits): one buffer, one copy to the host, and ids
    that need no conversion there (split_topk reads it)."""
    top = logits.float().topk(k, dim=-1)
    values = (top.values - lse[:, None]).view(torch.int32)
    return torch.cat([top.indices.to(torch.int32), values], dim=1)


def split_topk(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [rows, K], log-probabilities float32 [rows, K]), views of a packed result."""
    width = packed.shape[1] // 2
    return packed[:, :width], packed[:, width:].view(torch.float32)


def topk_logprobs(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """As topk_logprobs_ref, for K >= k alternatives (the first k are the k asked): the kernels
    on CUDA for float32 rows with K = k rounded up to a power of two (a few compiled variants,
    all warmed at start)."""
    K = triton.next_power_of_2(k)
    if (logits.device.type != "cuda" or logits.dtype != torch.float32
            or logits.stride(-1) != 1 or K > min(_MAX_K, logits.shape[1])):
        return topk_logprobs_ref(logits, lse, k)
    return topk_logprobs_triton(logits, lse, K)


def topk_logprobs_triton(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """k: a power of two."""
    rows, n = logits.shape
    assert logits.stride(-1) == 1 and lse.shape == (rows,) and 0 < k <= n and k & (k - 1) == 0
    num_slices = triton.cdiv(n, _SLICE)
    dev = logits.device
    smax = torch.empty(rows, num_slices, dtype=torch.float32, device=dev)
    vals = torch.empty(rows, k * k, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, k * k, dtype=torch.int32, device=dev)
    out = torch.empty(rows, 2 * k, dtype=torch.int32, device=dev)
    if rows:
        _slice_max_kernel[(rows, num_slices)](logits, smax, logits.stride(0), n, num_slices,
                                              SLICE=_SLICE)
        _slice_topk_kernel[(rows, k)](logits, smax, vals, idx, logits.stride(0), n, num_slices,
                                      SLICE=_SLICE, K=k, PAD=triton.next_power_of_2(num_slices))
        _merge_topk_kernel[(rows,)](vals, idx, lse.float().contiguous(), out, K=k)
    return out


def warm_topk(device: torch.device, vocab: int, max_k: int) -> None:
    """Compile every K variant before serving (a first request asking for k must not wait)."""
    x = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    lse = torch.zeros(1, dtype=torch.float32, device=device)
    k = 1
    while k <= min(triton.next_power_of_2(max_k), _MAX_K, vocab):
        topk_logprobs_triton(x, lse, k)
        k *= 2
