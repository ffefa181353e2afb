"""Each row's k largest logits as log-probabilities (the top alternatives of logprobs). A row's
K largest lie in the K slices of the vocabulary whose maxima are largest (a slice holding one
of them has at most K - 1 slices above it), so: pass 1 takes each slice's max, pass 2 (K
programs a row) takes the row's j-th best slice and that slice's K largest, pass 3 the K largest
of those K * K candidates. Each selection is Triton's bitonic top-k over keys that pack a value
(its float bits made order-preserving) above its reversed index, so ties go to the lowest token
id (and slices to the lowest slice) and the index rides along. K sequential max-reductions
instead, or torch's top-k (one thread block per 128k-wide row), cost several times more
(bench/README.md#logprobs-cost-h200).

Reference: topk_logprobs_ref (torch), the oracle of the kernel tests and the path off CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SLICE = 2048  # NOTE: vocabulary entries per slice
_MAX_K = 64  # NOTE: above, torch's top-k


@triton.jit
def _pack(x, index):
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # NOTE: negative floats' order reversed
    # NOTE: the low half 0x7FFFFFFF - index: larger for a lower index
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _unpack(key):
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _slice_max_kernel(X, SMAX, stride_x, n, num_slices, SLICE: tl.constexpr):
    r = tl.program_id(0)
    sl = tl.program_id(1)
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
    tl.store(SMAX + r * num_slices + sl, tl.max(x, 0))


@triton.jit
def _slice_topk_kernel(X, SMAX, KEYS, stride_x, n, num_slices, SLICE: tl.constexpr,
                       K: tl.constexpr, PAD: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.arange(0, PAD)
    m = tl.load(SMAX + r * num_slices + s, mask=s < num_slices, other=float("-inf"))
    best = tl.topk(_pack(m, s), K)  # NOTE: the row's K best slices (PAD >= K)
    sl = tl.sum(tl.where(tl.arange(0, K) == j, _unpack(best)[1], 0), 0)
    live = sl < num_slices  # NOTE: a row of fewer than K slices: -inf candidates past them
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=(cols < n) & live, other=float("-inf"))
    tl.store(KEYS + (r * K + j) * K + tl.arange(0, K), tl.topk(_pack(x, cols), K))


@triton.jit
def _merge_topk_kernel(KEYS, LSE, OUT, K: tl.constexpr):
    r = tl.program_id(0)
    top = tl.topk(tl.load(KEYS + r * K * K + tl.arange(0, K * K)), K)
    value, token = _unpack(top)
    i = tl.arange(0, K)
    tl.store(OUT + r * 2 * K + i, token)
    tl.store(OUT + r * 2 * K + K + i, (value - tl.load(LSE + r)).to(tl.int32, bitcast=True))


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
    on CUDA for float32 rows with K = k rounded up to a power of two >= 2 (a few compiled
    variants, all warmed at start)."""
    K = max(2, triton.next_power_of_2(k))  # NOTE: Triton's top-k takes 2 at least
    if (logits.device.type != "cuda" or logits.dtype != torch.float32
            or logits.stride(-1) != 1 or K > min(_MAX_K, logits.shape[1])):
        return topk_logprobs_ref(logits, lse, k)
    return topk_logprobs_triton(logits, lse, K)


def topk_logprobs_triton(logits: torch.Tensor, lse: torch.Tensor, k: int) -> torch.Tensor:
    """k: a power of two >= 2."""
    rows, n = logits.shape
    assert logits.stride(-1) == 1 and lse.shape == (rows,) and 2 <= k <= n and k & (k - 1) == 0
    num_slices = triton.cdiv(n, _SLICE)
    dev = logits.device
    smax = torch.empty(rows, num_slices, dtype=torch.float32, device=dev)
    keys = torch.empty(rows, k * k, dtype=torch.int64, device=dev)
    out = torch.empty(rows, 2 * k, dtype=torch.int32, device=dev)
    if rows:
        _slice_max_kernel[(rows, num_slices)](logits, smax, logits.stride(0), n, num_slices,
                                              SLICE=_SLICE)
        _slice_topk_kernel[(rows, k)](logits, smax, keys, logits.stride(0), n, num_slices,
                                      SLICE=_SLICE, K=k, PAD=max(k, triton.next_power_of_2(num_slices)))
        _merge_topk_kernel[(rows,)](keys, lse.float().contiguous(), out, K=k)
    return out


def warm_topk(device: torch.device, vocab: int, max_k: int) -> None:
    """Compile every K variant before serving (a first request asking for k must not wait)."""
    x = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    lse = torch.zeros(1, dtype=torch.float32, device=device)
    k = 2
    while k <= min(triton.next_power_of_2(max_k), _MAX_K, vocab):
        topk_logprobs_triton(x, lse, k)
        k *= 2
