"""AttentionBatch: where each token's K/V goes and what each query row may attend to.

Built once per step by the executor (batch_builder) and read by every attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hsserve.kernels.paged_prefill_attention import VarlenBatch


@dataclass
class Span:
    """Multi-token chunks of `num_seqs` sequences with equal shapes, in consecutive rows
    [row_start, row_start + num_seqs * num_rows); sequence i attends to slots[i] (its first
    ctx_len tokens). `mask` [num_rows, ctx_len] is None when plain causal attention over the
    whole context is exact (only such fresh prompts are grouped: num_seqs > 1)."""

    row_start: int
    num_rows: int
    slots: torch.Tensor  # [num_seqs, ctx_len]
    mask: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return self.slots.shape[0]


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    decode_rows: torch.Tensor | None = None  # [B] rows of single-token sequences
    # NOTE: padded with block 0; the bias hides every key past a sequence's length.
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    # [B, max_blocks * block_size] in the model dtype: 0 where visible, -inf elsewhere (an additive
    # mask built once per step; a boolean one is converted again by every layer)
    decode_bias: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None  # [B] int32: keys 0..len-1 visible
    # [>= B * kv_heads] int32 zeros the decode kernel counts its splits on (and leaves zero); the
    # decode graphs share one (their replays are serialized on one stream: two decode kernels
    # running at once must not share it); None: the kernel call allocates them
    decode_counters: torch.Tensor | None = None
    spans: list[Span] = field(default_factory=list)
    # NOTE: with the kernels, a step that is not all decode runs every row through one varlen
    # attention kernel per layer instead (decode rows, spans and the bias are then not built)
    varlen: VarlenBatch | None = None
    # NOTE: True where the Triton kernels run this batch (CUDA): decode rows then need only
    # block tables + lengths, and K/V writes skip negative slots (padding rows of a CUDA graph)
    kernels: bool = False
    # NOTE: True where the CPU's compiled kernels (kernels/cpu_ops.py) run the decode rows and
    # the K/V writes: decode rows then need only block tables + lengths, no mask
    cpu_kernels: bool = False
    # NOTE: the torch path where layers differ in window (Gemma 3): the sliding layers' masks
    windowed: AttentionBatch | None = None

    @property
    def all_decode(self) -> bool:
        """Every row is a single-token sequence, in batch order (decode rows = 0..B-1)."""
        return not self.spans and self.decode_rows is not None


def visible_keys(q_positions: torch.Tensor, ctx_len: int, window: int | None) -> torch.Tensor:
    """[len(q), ctx_len] bool: key j visible to a query at position p iff j <= p (and p - j < window)."""
    keys = torch.arange(ctx_len, device=q_positions.device)
    vis = keys[None, :] <= q_positions[:, None]
    if window is not None:
        vis &= keys[None, :] > q_positions[:, None] - window
    return vis
