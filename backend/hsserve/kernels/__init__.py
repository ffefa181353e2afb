"""Attention over the paged KV cache: Triton kernels on CUDA (decode-only steps: split-K decode;
any other step: one varlen kernel for all its rows), the torch reference elsewhere."""

from __future__ import annotations

from dataclasses import replace

import torch

from hsserve.models.attention_batch import AttentionBatch
from hsserve.kernels.paged_attention_ref import paged_attention_ref, write_kv


def kernels_supported(device: torch.device, block_size: int, head_dim: int) -> bool:
    """The Triton kernels need CUDA, power-of-two block size >= 16 and head_dim >= 16."""
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    if device.type != "cuda" or not (block_size >= 16 and pow2(block_size)):
        return False
    if not (head_dim >= 16 and pow2(head_dim)):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> None:
    if batch.kernels:
        from hsserve.kernels.paged_decode_attention import write_kv_triton

        write_kv_triton(kv, k, v, batch.slot_mapping)
    else:
        write_kv(kv, k, v, batch.slot_mapping)


def attend(q: torch.Tensor, kv: torch.Tensor, batch: AttentionBatch, scale: float,
           window: int | None, softcap: float | None = None) -> torch.Tensor:
    """softcap: Gemma 2's attention soft-capping (scores capped before the mask)."""
    if batch.kernels and batch.varlen is not None:
        from hsserve.kernels.paged_prefill_attention import paged_varlen_attention

        return paged_varlen_attention(q, kv, batch.varlen, scale, window, softcap=softcap)
    if batch.kernels and batch.all_decode:
        from hsserve.kernels.paged_decode_attention import paged_decode_attention

        return paged_decode_attention(q, kv, batch.decode_block_tables, batch.decode_seq_lens,
                                      scale, window, counters=batch.decode_counters,
                                      softcap=softcap)
    if batch.cpu_kernels and batch.decode_rows is not None:
        return _attend_cpu(q, kv, batch, scale, window, softcap)
    return paged_attention_ref(q, kv, batch, scale, softcap)


def _attend_cpu(q, kv, batch, scale, window, softcap):
    """Decode rows through the CPU kernel, multi-token spans through the reference."""
    from hsserve.kernels import cpu_ops

    rows = q if batch.all_decode else q.index_select(0, batch.decode_rows)
    o = cpu_ops.decode_attention(rows, kv, batch.decode_block_tables, batch.decode_seq_lens, scale,
                                 window, softcap)
    if batch.all_decode:
        return o
    out = paged_attention_ref(q, kv, replace(batch, decode_rows=None), scale, softcap)
    out[batch.decode_rows] = o
    return out
