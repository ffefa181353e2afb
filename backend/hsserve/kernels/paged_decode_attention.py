"""Triton kernels for the decode step over the paged KV cache (CUDA; TRITON_INTERPRET=1 on CPU).

- write_kv_triton: stores each new token's k/v at its slot; a negative slot (a padding row of a
  CUDA-graph batch) writes nothing.
- paged_decode_attention: one query token per sequence against its cached keys, split-K
  ("flash-decoding"): the pages of each sequence are spread over `num_splits` programs per KV
  head, each keeps an online softmax (max, sum, weighted values) over its pages for every query
  head of the KV head's group at once (GQA: the group's heads share each K/V load), 64 keys (whole
  pages) per loop step (one page per step left the kernel waiting on memory at batch 64); the
  last split of a (sequence, KV head) to finish, counted on an atomic counter, merges them, four
  splits per load (no merge kernel: bench/README.md#decode-attention-splits); with one split (a batch
  that fills the GPU) the program writes the output itself. A split takes one tile at least, so a
  short context runs on fewer splits (one: no merge); under PDL (batch 1) a split reads its first
  tile's older keys before it waits for the previous kernel, then only q and the query's own key
  and value (in the step the attention costs its latency, not its bandwidth). A sequence of length 0 (padding) yields zeros.

The torch reference (paged_attention_ref.py) is the oracle in tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsserve.kernels.online_softmax import online_softmax_step
from hsserve.kernels.pdl import pdl_enter, pdl_on


@triton.jit
def _write_kv_kernel(
    K, V, KV, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_half, stride_slot, stride_head,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(K + t * stride_kt + h * stride_kh + d)
        v = tl.load(V + t * stride_vt + h * stride_vh + d)
        base = KV + slot * stride_slot + h * stride_head + d
        tl.store(base, k)
        tl.store(base + stride_half, v)


def write_kv_triton(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv: one layer's cache [2, blocks, block_size, kv_heads, head_dim]; k/v [tokens, kv_heads,
    head_dim] (last dim contiguous); slots [tokens] int (negative = skip)."""
    t, kvh, d = k.shape
    if t == 0:
        return
    flat = kv.view(2, -1, kvh, d)
    _write_kv_kernel[(t, kvh)](
        k, v, flat, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        flat.stride(0), flat.stride(1), flat.stride(2),
        HEAD_DIM=d,
    )


@triton.jit(do_not_specialize=["window", "stride_tb"])  # NOTE: vary per step; no recompiles
def _decode_split_kernel(
    Q, KV, TABLES, LENS, ACC, STATS, OUT, COUNTERS,
    scale, window, softcap,
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_half, stride_block, stride_tok, stride_head,
    stride_tb,
    stride_ab, stride_ah, stride_as,
    stride_sb, stride_sh, stride_ss,
    NUM_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGES: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # NOTE: the lengths, the block tables and every key but the query's own were written before
    # this step's first kernel: read before the wait (PDL), so that only q and the query's own
    # key and value are read after the previous kernel is done
    seq_len = tl.load(LENS + b)
    first, last, active = _pages_of_split(seq_len, split, window, NUM_SPLITS, PAGES, BLOCK_SIZE)
    single = active == 1
    if split >= active:
        return  # NOTE: no pages: nothing to read, merge or wait for (ends at once; PDL allows it)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, PAGES * BLOCK_SIZE)  # NOTE: PAGES pages per iteration: fewer, wider steps
    heads = kvh * GROUP + g
    pos = seq_len - 1
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    start = first
    if PDL:  # NOTE: only with PDL does anything run before the previous kernel is done
        k, v, visible = _first_tile_around_wait(first, last, pos, window, n, d, b, kvh, TABLES,
                                                KV, stride_tb, stride_block, stride_tok,
                                                stride_head, stride_half, BLOCK_SIZE, PDL)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g < GROUP)[:, None], other=0.0)
    if PDL:
        m, l, acc = online_softmax_step(q, k, v, visible[None, :], m, l, acc, scale, IEEE,
                                        softcap, SOFTCAP)
        start = first + PAGES
    for page0 in range(start, last, PAGES):
        keys, visible, base = _tile(page0, last, pos, window, n, b, kvh, TABLES, KV, stride_tb,
                                    stride_block, stride_tok, stride_head, BLOCK_SIZE)
        k = tl.load(base[:, None] + d[None, :], mask=visible[:, None], other=0.0)
        v = tl.load(base[:, None] + stride_half + d[None, :], mask=visible[:, None], other=0.0)
        m, l, acc = online_softmax_step(q, k, v, visible[None, :], m, l, acc, scale, IEEE,
                                        softcap, SOFTCAP)
    if single:  # NOTE: split 0, the only active one
        o = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(OUT.dtype.element_ty), mask=(g < GROUP)[:, None])
    elif NUM_SPLITS > 1:  # NOTE: with one split (a batch that fills the GPU) always single
        _write_and_merge(ACC, STATS, OUT, COUNTERS, acc, m, l, b, kvh, split, active, heads,
                         g < GROUP, d, stride_ab, stride_ah, stride_as, stride_sb, stride_sh,
                         stride_ss, stride_ob, stride_oh, MERGE_CHUNK)


@triton.jit
def _pages_of_split(seq_len, split, window, NUM_SPLITS: tl.constexpr, PAGES: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr):
    """This split's pages [first, last) and the number of splits with pages. A split takes one
    tile at least (a short context: fewer splits, each read before the wait), so a context
    within one tile is the first split's alone and needs no merge; pages wholly outside the
    sliding window are skipped."""
    num_pages = tl.cdiv(seq_len, BLOCK_SIZE)
    per_split = tl.maximum(tl.cdiv(num_pages, NUM_SPLITS), PAGES)
    active = tl.maximum(tl.cdiv(num_pages, per_split), 1)
    first = split * per_split
    last = tl.minimum(first + per_split, num_pages)
    if window > 0:
        first = tl.maximum(first, (seq_len - window) // BLOCK_SIZE)
    return first, last, active


@triton.jit
def _first_tile_around_wait(first, last, pos, window, n, d, b, kvh, TABLES, KV, stride_tb,
                            stride_block, stride_tok, stride_head, stride_half,
                            BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    """The first tile's k, v: the older keys read before the wait for the previous kernel, the
    query's own key and value (written by it) after."""
    keys, visible, base = _tile(first, last, pos, window, n, b, kvh, TABLES, KV, stride_tb,
                                stride_block, stride_tok, stride_head, BLOCK_SIZE)
    old = (visible & (keys < pos))[:, None]
    k = tl.load(base[:, None] + d[None, :], mask=old, other=0.0)
    v = tl.load(base[:, None] + stride_half + d[None, :], mask=old, other=0.0)
    pdl_enter(PDL)
    own = (visible & (keys == pos))[:, None]
    k = tl.where(own, tl.load(base[:, None] + d[None, :], mask=own, other=0.0), k)
    v = tl.where(own, tl.load(base[:, None] + stride_half + d[None, :], mask=own, other=0.0), v)
    return k, v, visible


@triton.jit
def _tile(page0, last, pos, window, n, b, kvh, TABLES, KV, stride_tb, stride_block, stride_tok,
          stride_head, BLOCK_SIZE: tl.constexpr):
    """The tile of keys from page page0 on: (each key's position, whether the query sees it, its
    row's address in the cache)."""
    page = page0 + n // BLOCK_SIZE
    keys = page * BLOCK_SIZE + n % BLOCK_SIZE
    visible = (page < last) & (keys <= pos)
    if window > 0:
        visible = visible & (keys > pos - window)
    block = tl.load(TABLES + b * stride_tb + page, mask=page < last, other=0).to(tl.int64)
    base = KV + block * stride_block + kvh * stride_head + (n % BLOCK_SIZE) * stride_tok
    return keys, visible, base


@triton.jit
def _write_and_merge(ACC, STATS, OUT, COUNTERS, acc, m, l, b, kvh, split, active, heads, valid,
                     d, stride_ab, stride_ah, stride_as, stride_sb, stride_sh, stride_ss,
                     stride_ob, stride_oh, MERGE_CHUNK: tl.constexpr):
    """Store this split's (acc, m, l); the last of the `active` splits of (sequence, KV head)
    to finish merges them (no merge kernel; the splits without pages take no part)."""
    out = ACC + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + d[None, :]
    tl.store(out, acc, mask=valid[:, None])
    stats = STATS + b * stride_sb + heads * stride_sh + split * stride_ss
    tl.store(stats, m, mask=valid)
    tl.store(stats + 1, l, mask=valid)
    # NOTE: the counter's acq_rel add orders the other splits' stores before the loads below
    counter = COUNTERS + b * tl.num_programs(1) + kvh
    tl.debug_barrier()  # NOTE: every thread's stores above come before the add
    if tl.atomic_add(counter, 1) == active - 1:
        _merge_splits(ACC, STATS, OUT, b, heads, valid, d, m, acc, stride_ab, stride_ah,
                      stride_as, stride_sb, stride_sh, stride_ss, stride_ob, stride_oh, active,
                      MERGE_CHUNK)
        tl.store(counter, 0)  # NOTE: zero again for the next call (a graph replays it)


@triton.jit
def _merge_splits(ACC, STATS, OUT, b, heads, valid, d, like_m, like_acc, stride_ab, stride_ah,
                  stride_as, stride_sb, stride_sh, stride_ss, stride_ob, stride_oh, num_splits,
                  CHUNK: tl.constexpr):
    """out = sum over splits of acc * exp(m - max m) / sum of l * exp(m - max m), for the
    group's heads (rows) at once, CHUNK splits at a time with a running max: a short context's
    few splits in one load (the merging program is on the step's critical path:
    bench/README.md#decode-attention-splits); a split that saw
    no key has m = -inf and weighs nothing. like_m / like_acc: tensors of the running stats' /
    output's shape."""
    c = tl.arange(0, CHUNK)
    stats = STATS + b * stride_sb + heads[:, None] * stride_sh + c[None, :] * stride_ss
    part = (ACC + b * stride_ab + heads[:, None, None] * stride_ah + c[None, :, None] * stride_as
            + d[None, None, :])
    m_run = tl.zeros_like(like_m) - float("inf")
    l_run = tl.zeros_like(like_m)
    o = tl.zeros_like(like_acc)
    for s0 in range(0, num_splits, CHUNK):
        mask = valid[:, None] & (s0 + c < num_splits)[None, :]
        m = tl.load(stats + s0 * stride_ss, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(stats + s0 * stride_ss + 1, mask=mask, other=0.0, cache_modifier=".cg")
        a = tl.load(part + s0 * stride_as, mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        c_run = tl.exp(m_run - ref)  # NOTE: exp(-inf) = 0: no weight
        w = tl.exp(m - ref[:, None])
        o = o * c_run[:, None] + tl.sum(a * w[:, :, None], 1)
        l_run = l_run * c_run + tl.sum(l * w, 1)
        m_run = m_new
    o = o / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
             o.to(OUT.dtype.element_ty), mask=valid[:, None])


# NOTE: (keys per loop step of a split (whole pages), num_warps, num_stages), without and with
# PDL, by head size (bench/README.md#decode-attention-config)
_CONFIG = (64, 4, 3)
_PDL_CONFIG = {64: (128, 8, 1), 128: (64, 8, 2)}  # NOTE: head_dim -> config; others: _CONFIG
_MERGE_CHUNK = 4  # NOTE: splits merged per load (see _merge_splits)


def choose_num_splits(batch: int, kv_heads: int, max_pages: int, num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice, never more splits than pages; a power of two
    (the split count is a compile-time constant: at most 7 variants are ever compiled)."""
    want = min(-(-2 * num_sms // max(1, batch * kv_heads)), max_pages, 64)
    return 1 << (max(1, want).bit_length() - 1)


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, head_dim]; kv one layer [2, blocks, block_size, kv_heads, head_dim];
    block_tables [B, max_pages] int32; seq_lens [B] int32 (keys 0..len-1 visible; the query is
    at position len-1). Returns [B, heads, head_dim] in q's dtype. counters: int32 zeros, at
    least B * kv_heads, which the kernel leaves zero (a CUDA graph's buffer); None: allocated.
    config: (keys per loop step, num_warps, num_stages), for tuning; None: the defaults.
    softcap: Gemma 2's attention soft-capping (None: none)."""
    bsz, heads, d = q.shape
    _, _, block_size, kv_heads, _ = kv.shape
    group = heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(bsz, kv_heads, block_tables.shape[1])
    acc = torch.empty(bsz, heads, num_splits, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(bsz, heads, num_splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q) if out is None else out
    if bsz == 0:
        return out
    if counters is None:
        counters = torch.zeros(bsz * kv_heads, dtype=torch.int32, device=q.device)
    assert counters.numel() >= bsz * kv_heads and counters.dtype == torch.int32
    pdl = pdl_on(q)
    tokens, warps, stages = config or (_PDL_CONFIG.get(d, _CONFIG) if pdl else _CONFIG)
    _decode_split_kernel[(bsz, kv_heads, num_splits)](
        q, kv, block_tables, seq_lens, acc, stats, out, counters,
        scale, window or 0, softcap or 0.0,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        stats.stride(0), stats.stride(1), stats.stride(2),
        NUM_SPLITS=num_splits,
        MERGE_CHUNK=max(2, min(_MERGE_CHUNK, triton.next_power_of_2(num_splits))),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        HEAD_DIM=d,
        PAGES=max(1, tokens // block_size),
        IEEE=q.dtype == torch.float32,
        PDL=pdl, SOFTCAP=softcap is not None, launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )
    return out
