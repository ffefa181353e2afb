"""HiddenCapture: the forward's layer tap, storing chosen rows of the residual stream at chosen
layers as the decoder passes them (which rows and layers: engine/hidden_rows.py decides).

Index convention is transformers' `hidden_states[k]`: k = 0 the embeddings, 1 <= k < L the
output of layer k (the residual stream after its MLP add), k = L the final norm's output.
"""

from __future__ import annotations

import torch


class HiddenCapture:
    def __init__(
        self,
        layers: list[int],
        rows: torch.Tensor | None,
        hidden_size: int,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
        device: torch.device | None = None,
    ):
        """rows: the batch rows to keep, None for all of them (a CUDA graph's static batch);
        out: where to write ([rows, len(layers), hidden]), allocated when not given."""
        self.layers = layers  # normalized 0..L, in output column order
        self.rows = rows
        self._column = {k: i for i, k in enumerate(layers)}
        if out is None:
            n = len(rows) if rows is not None else 0
            out = torch.empty(n, len(layers), hidden_size, dtype=dtype,
                              device=rows.device if rows is not None else device)
        self.out = out

    def wants(self, k: int) -> bool:
        return k in self._column

    def store(self, k: int, x: torch.Tensor) -> None:
        """The rows of layer k's output x (every row of a graph's static batch, else self.rows)."""
        col = self._column.get(k)
        if col is not None:
            self.out[:, col] = x if self.rows is None else x[self.rows]


class Taps:
    """Two captures in one forward: the rows requests asked for and the EAGLE-3 drafter's layers
    (the same interface as HiddenCapture's, for the decoder)."""

    def __init__(self, *captures: HiddenCapture):
        self.captures = captures

    def wants(self, k: int) -> bool:
        return any(c.wants(k) for c in self.captures)

    def store(self, k: int, x: torch.Tensor) -> None:
        for c in self.captures:
            c.store(k, x)
