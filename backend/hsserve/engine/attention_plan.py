"""Attention metadata of a step: where each token's K/V goes in the paged cache (slots) and the
AttentionBatch the kernels or the torch path read (decode rows, prompt spans and their masks, the
varlen tables). Built from the chunks' block tables; the executor and the EAGLE-3 drafter (whose
K/V shares the target's block layout) each build theirs."""

from __future__ import annotations

import torch

from hsserve.engine.types import Chunk
from hsserve.kernels import cpu_ops, kernels_supported
from hsserve.kernels.paged_prefill_attention import varlen_metadata
from hsserve.models.attention_batch import AttentionBatch, Span, visible_keys
from hsserve.models.spec import ModelSpec

_SHORT_AS_DECODE = 8


class AttentionPlanner:
    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 block_size: int):
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.window = spec.sliding_window
        # NOTE: layers of two windows (Gemma 3): the torch path builds the sliding layers' masks too
        self.layer_window = next((w for w in spec.layer_windows if w is not None), None)
        self.kernels = kernels_supported(device, block_size, spec.head_dim)
        self.cpu_kernels = device.type == "cpu" and cpu_ops.supports(
            dtype, spec.num_heads, spec.head_dim)
        self.group = spec.num_heads // spec.num_kv_heads

    def _as_decode(self, c: Chunk) -> bool:
        """Rows attending as decodes, each to the keys up to its own position: one token; and off
        the GPU kernels a short chunk after cached keys (a draft's verify, the EAGLE-3 head's
        catch-up), which as a span would gather every key and build a mask each step."""
        return c.num_tokens == 1 or (not self.kernels and c.start > 0
                                     and c.num_tokens <= _SHORT_AS_DECODE)

    def slot(self, block_table: list[int], position: int) -> int:
        """Where the K/V of the token at `position` goes in the cache (a flat slot index)."""
        bs = self.block_size
        return block_table[position // bs] * bs + position % bs

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        return [self.slot(block_table, p) for p in range(start, end)]

    def batch(self, chunks: list[Chunk], slot_mapping: list[int]) -> AttentionBatch:
        batch = self._batch_for(chunks, slot_mapping, self.window)
        if self.layer_window is not None and not self.kernels:
            batch.windowed = self._batch_for(chunks, slot_mapping, self.layer_window)
        return batch

    def _batch_for(self, chunks: list[Chunk], slot_mapping: list[int],
                   window: int | None) -> AttentionBatch:
        dev = self.device
        batch = AttentionBatch(slot_mapping=torch.tensor(slot_mapping, device=dev),
                               kernels=self.kernels, cpu_kernels=self.cpu_kernels)
        decode = [(i, c) for i, c in enumerate(chunks) if self._as_decode(c)]
        row = 0
        rows_of = []
        for c in chunks:
            rows_of.append(row)
            row += c.num_tokens
        if self.kernels and len(decode) < len(chunks):  # NOTE: here decodes are single tokens
            bs = self.block_size
            batch.varlen = varlen_metadata(
                [(rows_of[i], c.num_tokens, c.start, c.seq.block_table[: -(-c.end // bs)])
                 for i, c in enumerate(chunks)], self.group, dev)
            return batch
        if decode:
            bs = self.block_size
            num_blocks = max(-(-c.end // bs) for _, c in decode)
            rows = [(rows_of[i] + j, c, c.start + j + 1) for i, c in decode
                    for j in range(c.num_tokens)]
            tables = [c.seq.block_table[:num_blocks] for _, c, _ in rows]
            batch.decode_rows = torch.tensor([r for r, _, _ in rows], device=dev)
            batch.decode_block_tables = torch.tensor(
                [t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev
            )
            lens = torch.tensor([n for _, _, n in rows], dtype=torch.int32, device=dev)
            batch.decode_seq_lens = lens
            if not (self.kernels or self.cpu_kernels):  # NOTE: the kernels read the lengths
                keys = torch.arange(num_blocks * bs, device=dev)
                mask = keys[None, :] < lens[:, None]
                if window is not None:
                    mask &= keys[None, :] > lens[:, None] - 1 - window
                bias = torch.zeros(mask.shape, dtype=self.dtype, device=dev)
                batch.decode_bias = bias.masked_fill_(~mask, float("-inf"))
        groups: list[tuple[int, int, list[list[int]], torch.Tensor | None]] = []
        for i, c in enumerate(chunks):
            if self._as_decode(c):
                continue
            slots = self.slots(c.seq.block_table, 0, c.end)
            plain = c.start == 0 and (window is None or c.end <= window)
            if plain and groups:
                start, n, members, mask = groups[-1]
                # NOTE: equal fresh prompts in consecutive rows share one attention call
                if mask is None and n == c.num_tokens and start + n * len(members) == rows_of[i]:
                    members.append(slots)
                    continue
            mask = None
            if not plain:
                mask = visible_keys(torch.arange(c.start, c.end, device=dev), c.end, window)
            groups.append((rows_of[i], c.num_tokens, [slots], mask))
        batch.spans = [
            Span(start, n, torch.tensor(members, device=dev), mask)
            for start, n, members, mask in groups
        ]
        return batch
