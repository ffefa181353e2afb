"""Row-wise argmax of the logits (greedy sampling) in two passes.

torch's argmax reduces a row of 128k logits in one thread block (bench/README.md#argmax-in-the-decode-graphs).
Here the vocabulary is split across programs: pass 1
writes each slice's (max, first index of it), pass 2 picks the first slice holding the row's
max, so ties resolve to the lowest index as torch's do. Pass 2 can also store each sample into
pinned host memory (through its unified address: no copy on the stream after the kernel), in
one of several host slots named by a device scalar, so that the decode graphs hand their samples
to the host without a device-to-host copy (bench/README.md#samples-to-pinned-host-memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SLICE = 2048  # NOTE: vocabulary entries per program of pass 1


@triton.jit
def _slice_max_kernel(X, VALS, IDX, stride_x, n, num_slices, SLICE: tl.constexpr):
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


@triton.jit
def _pick_kernel(VALS, IDX, OUT, HOST, SLOT, stride_host, num_slices, PAD: tl.constexpr,
                 TO_HOST: tl.constexpr):
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


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None,
                host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """logits [rows, vocab] float32 -> the first index of each row's max [rows] int64 (the
    kernels on CUDA, torch's argmax, their reference, elsewhere), into `out` when given (a
    contiguous int64 [rows]: the engine's samples buffer, no copy after). host: (pinned int64
    [slots, >= rows], device int64 scalar slot): the samples also go to that host row, written
    by the kernel (on CUDA; elsewhere copied)."""
    if logits.device.type != "cuda" or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        out = logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
        if host is not None:
            host[0][int(host[1]), : len(out)].copy_(out)
        return out
    return argmax_triton(logits, out, host)


def argmax_triton(logits: torch.Tensor, out: torch.Tensor | None = None,
                  host: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    rows, n = logits.shape
    num_slices = triton.cdiv(n, _SLICE)
    vals = torch.empty(rows, num_slices, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, num_slices, dtype=torch.int64, device=logits.device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    assert out.shape == (rows,) and out.dtype == torch.int64 and out.is_contiguous()
    if rows:
        _slice_max_kernel[(rows, num_slices)](logits, vals, idx, logits.stride(0), n, num_slices,
                                              SLICE=_SLICE)
        buf, slot = host if host is not None else (out, out)
        assert host is None or (buf.device.type == "cpu" and buf.dtype == torch.int64
                                and buf.shape[1] >= rows and buf.stride(1) == 1
                                and (buf.is_pinned() or triton.knobs.runtime.interpret))
        _pick_kernel[(rows,)](vals, idx, out, buf, slot, buf.stride(0), num_slices,
                              PAD=triton.next_power_of_2(num_slices), TO_HOST=host is not None)
    return out
