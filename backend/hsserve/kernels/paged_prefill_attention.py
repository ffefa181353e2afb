"""Triton kernel: attention of any step's rows (prompt chunks of any length and start, decode rows)
over the paged KV cache, in one launch per layer (CUDA; TRITON_INTERPRET=1 on CPU).

The rows of each chunk are cut into query blocks of at most `block_rows` rows; a program takes one
query block and one KV head, with the rows x the group's query heads folded into one tile (GQA:
each K/V load serves the whole group), and walks the chunk's pages from its first visible key to
its last row's position, 64 keys (whole pages) per step, with an online softmax. Causal: the row
at position p sees keys 0..p (and, with a sliding window, only those p - j < window).

`varlen_metadata` builds the per-block tables on the host; the torch reference
(paged_attention_ref.py) is the oracle in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsserve.kernels.online_softmax import online_softmax_step

_TILE_ROWS = 64  # NOTE: query rows x group heads per program
_TOKENS_PER_STEP = 64


@dataclass
class VarlenBatch:
    """Query blocks of one step: block b covers rows [row0[b], row0[b] + rows[b]) of q, at positions
    pos0[b] + 0.., of sequence seq[b], whose keys 0..ctx[seq] - 1 live in pages tables[seq]."""

    row0: torch.Tensor  # [NB] int32
    rows: torch.Tensor  # [NB] int32
    pos0: torch.Tensor  # [NB] int32
    seq: torch.Tensor  # [NB] int32
    tables: torch.Tensor  # [S, max_pages] int32
    ctx: torch.Tensor  # [S] int32
    block_rows: int


def block_rows_for(group: int) -> int:
    return max(1, _TILE_ROWS // triton.next_power_of_2(group))


def varlen_metadata(chunks: list[tuple[int, int, int, list[int]]], group: int,
                    device: torch.device) -> VarlenBatch:
    """chunks: (first row in q, number of rows, position of the first row, block table); the
    chunk's context ends at its last row (position + rows)."""
    br = block_rows_for(group)
    row0, rows, pos0, seq = [], [], [], []
    width = max(len(t) for *_, t in chunks)
    for s, (r, n, p, _) in enumerate(chunks):
        for i in range(0, n, br):
            row0.append(r + i)
            rows.append(min(br, n - i))
            pos0.append(p + i)
            seq.append(s)
    nb = len(row0)
    pad = [0] * (-nb % 4)  # NOTE: each row starts 16-byte aligned, so Triton compiles one variant
    meta = torch.tensor([row0 + pad, rows + pad, pos0 + pad, seq + pad], dtype=torch.int32)
    tables = torch.tensor([t + [0] * (width - len(t)) for *_, t in chunks], dtype=torch.int32)
    ctx = torch.tensor([p + n for _, n, p, _ in chunks], dtype=torch.int32)
    meta, tables, ctx = (x.to(device, non_blocking=True) for x in (meta, tables, ctx))
    meta = meta[:, :nb]  # NOTE: sliced on the device (a copy of the slice would be contiguous)
    return VarlenBatch(meta[0], meta[1], meta[2], meta[3], tables, ctx, br)


@triton.jit(do_not_specialize=["window", "stride_tb"])  # NOTE: vary per step; no recompiles
def _varlen_kernel(
    Q, KV, OUT, ROW0, ROWS, POS0, SEQ, TABLES, CTX,
    scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_half, stride_block, stride_tok, stride_head, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGES: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(ROW0 + qb)
    nrows = tl.load(ROWS + qb)
    pos0 = tl.load(POS0 + qb)
    s = tl.load(SEQ + qb)
    ctx = tl.load(CTX + s)

    m_idx = tl.arange(0, BLOCK_ROWS * GROUP_PAD)  # NOTE: (row, head of the group) pairs
    r = m_idx // GROUP_PAD
    g = m_idx % GROUP_PAD
    ok = (r < nrows) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (row0 + r)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0)
    q_pos = pos0 + r

    m = tl.full([BLOCK_ROWS * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_ROWS * GROUP_PAD, HEAD_DIM], tl.float32)
    last_key = tl.minimum(ctx, pos0 + nrows)  # NOTE: exclusive; keys past the last row are unseen
    first_page = tl.where(window > 0, tl.maximum(pos0 - window + 1, 0) // BLOCK_SIZE, 0)
    last_page = tl.cdiv(last_key, BLOCK_SIZE)
    n = tl.arange(0, PAGES * BLOCK_SIZE)
    for page0 in range(first_page, last_page, PAGES):
        page = page0 + n // BLOCK_SIZE
        keys = page * BLOCK_SIZE + n % BLOCK_SIZE
        in_ctx = keys < last_key
        block = tl.load(TABLES + s * stride_tb + page, mask=page < last_page, other=0).to(tl.int64)
        base = KV + block * stride_block + kvh * stride_head + (n % BLOCK_SIZE) * stride_tok
        k = tl.load(base[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
        v = tl.load(base[:, None] + stride_half + d[None, :], mask=in_ctx[:, None], other=0.0)
        visible = in_ctx[None, :] & (keys[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - window)
        m, l, acc = online_softmax_step(q, k, v, visible, m, l, acc, scale, IEEE, softcap,
                                        SOFTCAP)
    o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(OUT + (row0 + r)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             o.to(OUT.dtype.element_ty), mask=ok[:, None])


def paged_varlen_attention(q: torch.Tensor, kv: torch.Tensor, vb: VarlenBatch, scale: float,
                           window: int | None = None, out: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """q [tokens, heads, head_dim]; kv one layer [2, blocks, block_size, kv_heads, head_dim].
    Rows not covered by a query block are left as they are in `out`. softcap: Gemma 2's."""
    _, heads, d = q.shape
    _, _, block_size, kv_heads, _ = kv.shape
    assert heads % kv_heads == 0 and q.stride(-1) == 1 and kv.stride(-1) == 1, "unsupported layout"
    assert vb.tables.dtype == torch.int32 and vb.row0.dtype == torch.int32
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    nb = vb.row0.shape[0]
    if nb == 0:
        return out
    _varlen_kernel[(nb, kv_heads)](
        q, kv, out, vb.row0, vb.rows, vb.pos0, vb.seq, vb.tables, vb.ctx,
        scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), vb.tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_ROWS=vb.block_rows,
        BLOCK_SIZE=block_size, HEAD_DIM=d, PAGES=max(1, _TOKENS_PER_STEP // block_size),
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None,
    )
    return out
