"""HiddenCapture: copies chosen rows of the residual stream at chosen layers during a forward.

Index convention is transformers' `hidden_states[k]`: k = 0 the embeddings, 1 <= k < L the
output of layer k (the residual stream after its MLP add), k = L the final norm's output.
"""

from __future__ import annotations

import torch


class HiddenCapture:
    def __init__(self, layers: list[int], rows: torch.Tensor, hidden_size: int, dtype: torch.dtype):
        self.layers = layers  # normalized 0..L, in output column order
        self.rows = rows  # [R] batch rows to keep
        self._column = {k: i for i, k in enumerate(layers)}
        self.out = torch.empty(len(rows), len(layers), hidden_size, dtype=dtype, device=rows.device)

    def take(self, k: int, x: torch.Tensor) -> None:
        col = self._column.get(k)
        if col is not None:
            self.out[:, col] = x[self.rows]
