"""Torch reference for attention over the paged KV cache, and the KV write.

KV layout (shared with the GPU kernels): per layer a tensor [2, num_blocks, block_size, kv_heads,
head_dim] (keys, values); token slot s lives at block s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hsserve.models.attention_batch import AttentionBatch


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k/v [tokens, kv_heads, head_dim] at their slots of one layer's cache."""
    kv[0].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    kv[1].view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def _gather(flat: torch.Tensor, index: torch.Tensor, half: int) -> torch.Tensor:
    """Rows `index` of the keys then of the values, where flat = keys ++ values (`half` rows each).

    NOTE: one index_select along dim 0 (faster than one along dim 1 of [2, ...])."""
    return flat.index_select(0, torch.cat((index, index + half)))


def _attention(q, k, v, mask, scale: float, softcap: float | None, causal: bool = False):
    """scaled_dot_product_attention (mask additive or boolean; causal: no mask), or with softcap
    the same by hand with the scores capped (cap * tanh(s / cap)) before the mask, as Gemma 2."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              is_causal=causal, enable_gqa=q.shape[-3] != k.shape[-3])
    if q.shape[-3] != k.shape[-3]:  # NOTE: grouped heads: each KV head serves a group
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    wide = torch.promote_types(q.dtype, torch.float32)  # NOTE: float32, or float64 (an oracle)
    s = torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(wide)
    return torch.matmul(torch.softmax(s, dim=-1), v.to(wide)).to(q.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim].

    Single-token (decode) rows are attended together over a gathered, masked context; each
    multi-token span (prefill chunk) attends causally to its own context.
    """
    kv_heads, head_dim = kv.shape[-2:]
    out = torch.empty_like(q)
    if batch.decode_rows is not None:
        n = len(batch.decode_rows)
        # NOTE: gather whole blocks of keys and values in one index_select (faster than [])
        gathered = _gather(kv.flatten(0, 1), batch.decode_block_tables.view(-1), kv.shape[1])
        gathered = gathered.view(2, n, -1, kv_heads, head_dim).transpose(2, 3)
        k, v = gathered[0], gathered[1]
        qd = q if batch.all_decode else q.index_select(0, batch.decode_rows)
        # NOTE: one query per sequence, so the heads sharing a KV head are folded into the
        # query axis ([B, kvh, group, d]): plain attention, no GQA expansion (faster on CPU)
        o = _attention(qd.view(n, kv_heads, -1, head_dim), k, v,
                       batch.decode_bias[:, None, None, :], scale, softcap).reshape(n, -1, head_dim)
        if batch.all_decode:
            return o
        out[batch.decode_rows] = o
    for span in batch.spans:
        g, n = span.num_seqs, span.num_rows
        end = span.row_start + g * n
        qs = q[span.row_start : end].view(g, n, -1, head_dim).transpose(1, 2)  # [g, h, n, d]
        slots_per_half = kv.shape[1] * kv.shape[2]
        gathered = _gather(kv.view(-1, kv_heads, head_dim), span.slots.view(-1), slots_per_half)
        gathered = gathered.view(2, g, -1, kv_heads, head_dim).transpose(2, 3)
        k, v = gathered[0], gathered[1]
        # NOTE: no mask: whole prompts, no window: plain causal
        mask = span.mask[None, None] if span.mask is not None else None
        o = _attention(qs, k, v, mask, scale, softcap, causal=span.mask is None)
        out[span.row_start : end] = o.transpose(1, 2).reshape(g * n, -1, head_dim)
    return out
