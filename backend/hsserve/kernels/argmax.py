"""Row-wise argmax of the logits (greedy sampling) in two passes.

torch's argmax reduces a row of 128k logits in one thread block (bench/README.md#argmax-in-the-decode-graphs).
Here the vocabulary is split across programs: pass 1
writes each slice's (max, first index of it), pass 2 picks the first slice holding the row's
max, so ties resolve to the lowest index as torch's do. Pass 2 can also store each sample into
pinned host memory (through its unified address: no copy on the stream after the kernel), in
one of several host slots named by a device scalar, so that the decode graphs hand their samples
to the host without a device-to-host copy (bench/README.md#samples-to-pinned-host-memory).
Asked (`lse`), pass 1 also sums each slice's exponentials and pass 2 gives each row's logsumexp
and the greedy token's log-probability, for logprobs at no extra pass over the vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SLICE = 2048  # NOTE: vocabulary entries per program of pass 1


@triton.jit
def _slice_max_kernel(X, VALS, IDX, SUMS, stride_x, n, num_slices, SLICE: tl.constexpr,
                      WITH_LSE: tl.constexpr):
    r = tl.program_id(0)
    sl = tl.program_id(1)
    cols = sl * SLICE + tl.arange(0, SLICE)
    x = tl.load(X + r * stride_x + cols, mask=cols < n, other=float("-inf"))
    best = tl.max(x, 0)
    # NOTE: the first column holding the slice's max (lowest index on ties)
    # NOTE: clamped: a NaN slice matches nothing (torch would return the NaN's index; here a
    # valid token id at least, never one past the vocabulary)
    first = tl.minimum(tl.min(tl.where(x == best, cols, n), 0), n - 1)
    tl.store(VALS + r * num_slices + sl, best)
    tl.store(IDX + r * num_slices + sl, first)
    if WITH_LSE:  # NOTE: relative to the slice's max; an all -inf slice sums to 0
        ref = tl.where(best == float("-inf"), 0.0, best)
        tl.store(SUMS + r * num_slices + sl, tl.sum(tl.exp(x - ref), 0))


@triton.jit
def _pick_kernel(VALS, IDX, SUMS, OUT, HOST, SLOT, stride_host, LSE, HOST_LP, stride_lp,
                 num_slices, PAD: tl.constexpr, TO_HOST: tl.constexpr, WITH_LSE: tl.constexpr):
    r = tl.program_id(0)
    s = tl.arange(0, PAD)
    v = tl.load(VALS + r * num_slices + s, mask=s < num_slices, other=float("-inf"))
    best = tl.max(v, 0)
    k = tl.min(tl.where(v == best, s, PAD), 0)  # NOTE: the first slice holding the max
    k = tl.minimum(k, num_slices - 1)  # NOTE: a NaN row matches nothing: stay in the row
    token = tl.load(IDX + r * num_slices + k)
    tl.store(OUT + r, token)
    if TO_HOST:
        tl.store(HOST + tl.load(SLOT) * stride_host + r, token)
    if WITH_LSE:
        ref = tl.where(best == float("-inf"), 0.0, best)
        sums = tl.load(SUMS + r * num_slices + s, mask=s < num_slices, other=0.0)
        vals = tl.where(v == float("-inf"), 0.0, tl.exp(v - ref))
        lse = ref + tl.log(tl.sum(sums * vals, 0))
        tl.store(LSE + r, lse)
        at = HOST_LP + tl.load(SLOT) * stride_lp * 2  # NOTE: [slot, (logprob, lse), row]
        tl.store(at + r, best - lse)
        tl.store(at + stride_lp + r, lse)


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None,
                host: tuple[torch.Tensor, torch.Tensor] | None = None,
                lse: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """logits [rows, vocab] float32 -> the first index of each row's max [rows] int64 (the
    kernels on CUDA, torch's argmax, their reference, elsewhere), into `out` when given (a
    contiguous int64 [rows]: the engine's samples buffer, no copy after). host: (pinned int64
    [slots, >= rows], device int64 scalar slot): the samples also go to that host row, written
    by the kernel (on CUDA; elsewhere copied). lse (with host): (float32 [rows] on the device,
    pinned float32 [slots, 2, >= rows]): each row's logsumexp there, and in host slot `slot`
    (the greedy token's log-probability, the logsumexp)."""
    if logits.device.type != "cuda" or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        out = logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
        if host is not None:
            host[0][int(host[1]), : len(out)].copy_(out)
        if lse is not None:
            total = torch.logsumexp(logits.float(), dim=-1)
            lse[0].copy_(total)
            at = lse[1][int(host[1]), :, : len(out)]
            at.copy_(torch.stack([logits.max(dim=-1).values - total, total]))
        return out
    return argmax_triton(logits, out, host, lse)


def _check_host(buf: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    assert buf.device.type == "cpu" and buf.dtype == dtype and buf.shape[-1] >= rows
    assert buf.stride(-1) == 1 and (buf.is_pinned() or triton.knobs.runtime.interpret)


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None,
                  host: tuple[torch.Tensor, torch.Tensor] | None = None,
                  lse: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    rows, n = logits.shape
    num_slices = triton.cdiv(n, _SLICE)
    vals = torch.empty(rows, num_slices, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, num_slices, dtype=torch.int64, device=logits.device)
    sums = torch.empty_like(vals) if lse is not None else vals
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    assert lse is None or host is not None, "logsumexp to the host goes with the samples"
    if rows:
        _slice_max_kernel[(rows, num_slices)](logits, vals, idx, sums, logits.stride(0), n,
                                              num_slices, SLICE=_SLICE, WITH_LSE=lse is not None)
        buf, slot = host if host is not None else (out, out)
        if host is not None:
            _check_host(buf, torch.int64, rows)
        dev_lse, host_lp = lse if lse is not None else (vals, vals)
        if lse is not None:
            _check_host(host_lp, torch.float32, rows)
            assert host_lp.shape[1] == 2 and host_lp.is_contiguous()
            assert dev_lse.shape == (rows,) and dev_lse.dtype == torch.float32
        _pick_kernel[(rows,)](vals, idx, sums, out, buf, slot, buf.stride(0), dev_lse, host_lp,
                              host_lp.stride(1), num_slices,
                              PAD=triton.next_power_of_2(num_slices), TO_HOST=host is not None,
                              WITH_LSE=lse is not None)
    return out
