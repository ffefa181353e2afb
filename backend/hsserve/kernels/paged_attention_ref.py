"""Torch reference for attention over the paged KV cache, and the KV write.

KV layout (shared with the GPU kernels): per layer a tensor [num_blocks, block_size, kv_heads,
head_dim]; token slot s lives at block s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hsserve.attention_batch import AttentionBatch


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store k/v [tokens, kv_heads, head_dim] at their slots."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim].

    Single-token (decode) rows are attended together over a gathered, masked context; each
    multi-token span (prefill chunk) attends causally to its own context.
    """
    kv_heads, head_dim = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, kv_heads, head_dim)
    v_flat = v_cache.view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        n = len(batch.decode_rows)
        # NOTE: gather whole blocks (contiguous); index_select measured 2.5x faster than [] here
        tables = batch.decode_block_tables.view(-1)
        k = k_cache.index_select(0, tables).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, tables).view(n, -1, kv_heads, head_dim).transpose(1, 2)
        qd = q if batch.all_decode else q.index_select(0, batch.decode_rows)
        # NOTE: one query per sequence, so the heads sharing a KV head are folded into the
        # query axis ([B, kvh, group, d]): plain attention, no GQA expansion (faster on CPU)
        o = F.scaled_dot_product_attention(
            qd.view(n, kv_heads, -1, head_dim), k, v,
            attn_mask=batch.decode_mask[:, None, None, :], scale=scale,
        ).reshape(n, -1, head_dim)
        if batch.all_decode:
            return o
        out[batch.decode_rows] = o
    for span in batch.spans:
        g, n = span.num_seqs, span.num_rows
        end = span.row_start + g * n
        qs = q[span.row_start : end].view(g, n, -1, head_dim).transpose(1, 2)  # [g, h, n, d]
        slots = span.slots.view(-1)
        k = k_flat.index_select(0, slots).view(g, -1, kv_heads, head_dim).transpose(1, 2)
        v = v_flat.index_select(0, slots).view(g, -1, kv_heads, head_dim).transpose(1, 2)
        if span.mask is None:  # NOTE: whole prompts, no window: plain causal
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(
                qs, k, v, attn_mask=span.mask[None, None], scale=scale, enable_gqa=True
            )
        out[span.row_start : end] = o.transpose(1, 2).reshape(g * n, -1, head_dim)
    return out
