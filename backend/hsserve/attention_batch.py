"""AttentionBatch: where each token's K/V goes and what each query row may attend to.

Built once per step by the executor (batch_builder) and read by every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Span:
    """A multi-token chunk of one sequence: rows [row_start, row_start + num_rows) of the batch,
    attending to `slots` (the sequence's first ctx_len tokens). `mask` [num_rows, ctx_len] is
    None when plain causal attention over the whole context is exact."""

    row_start: int
    num_rows: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    decode_rows: torch.Tensor | None = None  # [B] rows of single-token sequences
    # NOTE: padded with block 0; the mask hides every key past a sequence's length.
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_mask: torch.Tensor | None = None  # [B, max_blocks * block_size] True where visible
    spans: list[Span] = field(default_factory=list)

    @property
    def all_decode(self) -> bool:
        """Every row is a single-token sequence, in batch order (decode rows = 0..B-1)."""
        return not self.spans and self.decode_rows is not None


def visible_keys(
    q_positions: torch.Tensor, ctx_len: int, window: int | None, width: int | None = None
) -> torch.Tensor:
    """[len(q), width] bool: key j visible to a query at position p iff j <= p (and p - j < window)."""
    keys = torch.arange(width if width is not None else ctx_len, device=q_positions.device)
    vis = (keys[None, :] <= q_positions[:, None]) & (keys[None, :] < ctx_len)
    if window is not None:
        vis &= keys[None, :] > q_positions[:, None] - window
    return vis
