"""What one step captured: `RowPlan`, which token rows of which chunk leave the device (made by
HiddenRows.plan), and `StepRows`, those rows, cut out per sequence in the output dtype, once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hsserve.engine.transfer import download, fetch


@dataclass(slots=True)
class RowPlan:
    """One step's capture plan: per chunk (first, count) of its rows in the step's block (a
    chunk's rows are always its last `count` tokens'), the chunks with rows, and the layers
    asked for (ascending)."""

    slices: list[tuple[int, int]]
    with_rows: list[int]
    layers: list[int]
    last_only: bool  # every captured row is MODE=last: the block may stay on the device


class StepRows:
    """One step's rows [rows, len(layers), hidden] in the model's dtype: on the host, or (all
    MODE=last, `stream` given) left on the device and copied out only if a row is taken; `live`:
    they are the decode graphs' static buffer, which the next replay rewrites (see settle)."""

    def __init__(self, block: torch.Tensor, layers: list[int],
                 stream: torch.cuda.Stream | None = None, live: bool = False):
        self.block: torch.Tensor | None = block
        self.layers = layers
        self._column = {k: i for i, k in enumerate(layers)}
        self._stream = stream
        self.live = live
        self._ready: torch.cuda.Event | None = None  # NOTE: set while a settle copy is queued
        self._np: np.ndarray | None = None

    def settle(self, needed: bool) -> None:
        """Live rows, before the next replay is queued: a host copy queued ahead of it when
        `needed`, else dropped."""
        if needed and self.block.is_cuda:
            self.block = download(self.block)
            self._ready = torch.cuda.Event()
            self._ready.record()
        elif needed:
            self.block = self.block.clone()
        else:
            self.block = None
        self._stream, self.live = None, False

    def take(self, first: int, count: int, wanted: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """Rows first..first+count-1 of the layers `wanted` (in that order) as a new host tensor
        [count, len(wanted) * hidden] of `dtype`. Called once the step completed."""
        if self.block is None:
            raise RuntimeError("hidden rows taken after they were dropped")
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        if self._stream is not None:  # NOTE: a device block comes to the host once, when first used
            self.block, self._stream, self.live = fetch(self.block, self._stream), None, False
        if self._np is None:  # NOTE: numpy views: a take is several times cheaper than torch's
            b = self.block
            bf16 = b.dtype == torch.bfloat16
            self._np = b.view(torch.int16).numpy().view(np.uint16) if bf16 else b.numpy()
        rows = self._np[first : first + count]
        if list(wanted) != self.layers:
            rows = rows[:, [self._column[k] for k in wanted]]
        return _to_dtype(rows.reshape(count, -1), self.block.dtype, dtype)


def _to_dtype(rows: np.ndarray, src: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """A copy (never a view of the step's block) of host rows in `dtype`."""
    if src == torch.bfloat16:  # NOTE: rows are bfloat16 bits, the high half of a float32
        if dtype == torch.bfloat16:
            return torch.from_numpy(rows.copy()).view(torch.bfloat16)
        wide = rows.astype(np.uint32)
        wide <<= 16
        out = torch.from_numpy(wide.view(np.float32))
        return out if dtype == torch.float32 else out.to(dtype)
    out = torch.from_numpy(rows)
    return out.clone() if out.dtype == dtype else out.to(dtype)
