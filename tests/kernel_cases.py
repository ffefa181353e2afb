"""Kernel-vs-reference checks shared by the CPU run (Triton's interpreter) and the GPU run."""

from __future__ import annotations

import torch

from hsserve.models.attention_batch import AttentionBatch
from hsserve.kernels.paged_attention_ref import paged_attention_ref, write_kv
from hsserve.kernels.paged_decode_attention import paged_decode_attention, write_kv_triton


def reference_decode(q, kv, tables, lens, scale, window, softcap=None):
    bs = kv.shape[2]
    keys = torch.arange(tables.shape[1] * bs, device=q.device)
    lens_l = lens.long()
    mask = keys[None] < lens_l[:, None]
    if window:
        mask &= keys[None] > lens_l[:, None] - 1 - window
    bias = torch.zeros(mask.shape, dtype=torch.float64, device=q.device).masked_fill_(~mask, float("-inf"))
    batch = AttentionBatch(slot_mapping=torch.zeros(len(q), dtype=torch.long, device=q.device),
                           decode_rows=torch.arange(len(q), device=q.device),
                           decode_block_tables=tables.long(), decode_bias=bias)
    out = paged_attention_ref(q.double(), kv.double(), batch, scale, softcap)
    return torch.where(lens[:, None, None] > 0, out, torch.zeros_like(out))  # NOTE: empty rows -> 0


def check_decode(device, dtype, heads, kv_heads, head_dim, lens, window=None, num_splits=None,
                 block_size=16, seed=0, softcap=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = 4 + sum(-(-n // block_size) for n in lens)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    width = max(1, max(-(-n // block_size) for n in lens))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width + 2, dtype=torch.int32)  # NOTE: wider than needed
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // block_size)
        tables[i, :k] = perm[used : used + k].int()
        used += k
    tables = tables.to(device)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(device, dtype)
    if softcap:  # NOTE: scores well past the cap, so that capping changes the result
        q = q * 8
    scale = head_dim**-0.5
    counters = torch.zeros(len(lens) * kv_heads + 3, dtype=torch.int32, device=device)
    ref = reference_decode(q, kv, tables[:, :width], lens_t, scale, window, softcap)
    for _ in range(2):  # NOTE: the second call runs on the counters the first left
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kv, tables, lens_t, scale, window, num_splits, out=out,
                               counters=counters, softcap=softcap)
        assert not torch.isnan(out).any(), "every output element must be written"
        err = (out.double() - ref).norm() / ref.norm().clamp_min(1e-12)
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), float(err)
        assert not counters.any(), "the split counters are left zero"


def check_write_kv(device, dtype, kv_heads=3, head_dim=64, block_size=16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = torch.randn(2, 6, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    qkv = torch.randn(5, 2 + 2 * kv_heads, head_dim, generator=g).to(device, dtype)
    k, v = qkv[:, 2 : 2 + kv_heads], qkv[:, 2 + kv_heads :]  # strided views, as in the model
    slots = torch.tensor([3, -1, 95, 17, 40], device=device)
    ours, ref = kv.clone(), kv.clone()
    write_kv_triton(ours, k, v, slots)
    keep = slots >= 0
    write_kv(ref, k[keep], v[keep], slots[keep])
    assert torch.equal(ours, ref)


def _close(out, ref, dtype, fp32_tol=1e-6):
    assert not torch.isnan(out).any()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < (fp32_tol if dtype == torch.float32 else 2e-2), float(err)


def check_elementwise(device, dtype, rows=5, hidden=576, inter=1536, seed=0):
    from hsserve.kernels.elementwise import (add_rmsnorm_ref, add_rmsnorm_triton, rms_inverse_ref,
                                             rotary_, rotary_ref, silu_mul_ref, silu_mul_triton)

    g = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    x, r, w = rnd(rows, hidden), rnd(rows, hidden), rnd(hidden)
    for residual in (None, r):
        out, total = add_rmsnorm_triton(x, residual, w, 1e-5)
        ref_out, ref_total = add_rmsnorm_ref(x.double(), None if residual is None else r.double(),
                                             w.double(), 1e-5)
        _close(out, ref_out, dtype)
        _close(total, ref_total, dtype)
    wide = torch.full((rows, hidden), float("nan"), dtype=torch.float64, device=device)
    out, _ = add_rmsnorm_triton(x, r, w, 1e-5, out64=wide)
    assert torch.equal(wide, out.double()), "the float64 copy holds the same rounded values"
    gu = rnd(rows, 2 * inter)
    _close(silu_mul_triton(gu), silu_mul_ref(gu.double()), dtype)
    stream = 7 * rnd(rows, hidden)  # NOTE: the rows whose 1 / rms scales gate and up (folded norm)
    want = silu_mul_ref(gu.double(), stream.double(), 1e-5)
    _close(silu_mul_triton(gu, stream, 1e-5), want, dtype)
    inv = rms_inverse_ref(stream.double(), 1e-5)
    _close(want, silu_mul_ref(gu.double() * inv), torch.float64)
    qkv = rnd(rows, 12, 64)
    pos = torch.tensor([0, 1, 17, 300, 4095][:rows], device=device).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=device).float() / 64))
    freqs = pos[:, None] * inv[None]
    view = qkv[:, :8]  # q and k heads of a fused qkv row: a strided view, rotated in place
    want = rotary_ref(view.double(), freqs.cos().double(), freqs.sin().double())
    rest = qkv[:, 8:].clone()
    rotary_(view, freqs.cos(), freqs.sin())
    _close(qkv[:, :8], want, dtype)
    assert torch.equal(qkv[:, 8:], rest)


def _rope(positions, head_dim, device):
    """float32 cos, sin [tokens, head_dim // 2] of the given positions (theta 500000)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.tensor(positions, device=device).float()[:, None] * inv[None]
    return freqs.cos(), freqs.sin()


def _rotary_store_expected(scaled, heads, kv_heads, cos, sin, kv, slots):
    """What rotary_store_ leaves, in float64, from the already-scaled qkv [tokens, heads + 2 *
    kv_heads, head_dim]: the rotated q heads, and the cache with rotated k and v written at the
    non-negative slots."""
    from hsserve.kernels.elementwise import rotary_ref

    rotated = rotary_ref(scaled[:, : heads + kv_heads], cos.double(), sin.double())
    want_kv = kv.double()
    keep = slots >= 0
    write_kv(want_kv, rotated[keep, heads:], scaled[keep, heads + kv_heads :], slots[keep])
    return rotated[:, :heads], want_kv


def _qk_normed(qkv, qw, kw, heads, kv_heads, eps=1e-6):
    """qkv [tokens, heads + 2 * kv_heads, head_dim] float64: its q and k heads RMS-normed in place
    (Qwen3's q/k norm)."""
    for w, lo, hi in ((qw, 0, heads), (kw, heads, heads + kv_heads)):
        part = qkv[:, lo:hi]
        part *= torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def check_rotary_store(device, dtype, heads=8, kv_heads=2, head_dim=64, seed=0, rms=False,
                       qk_norm=False):
    """rms: q, k, v scaled first by the 1 / rms of a stream row per token (folded norm); qk_norm:
    each q and k head RMS-normed (its own weight for q and for k) before the rotation."""
    from hsserve.kernels.elementwise import rms_inverse_ref, rotary_store_

    g = torch.Generator(device="cpu").manual_seed(seed)
    t = 5
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=g).to(device, dtype)
    kv = torch.randn(2, 4, 16, kv_heads, head_dim, generator=g).to(device, dtype)
    stream = (5 * torch.randn(t, 300, generator=g)).to(device, dtype) if rms else None
    slots = torch.tensor([0, 17, -1, 63, 40], device=device)
    cos, sin = _rope([0, 3, 9, 700, 5000], head_dim, device)
    scaled = qkv.double()
    if rms:
        scaled = scaled * rms_inverse_ref(stream.double(), 1e-6)[:, :, None]
    norms = None
    if qk_norm:
        qw, kw = (1 + 0.3 * torch.randn(2, head_dim, generator=g)).to(device, dtype)
        norms = (qw, kw, 1e-6)
        _qk_normed(scaled, qw, kw, heads, kv_heads)
    want_q, want_kv = _rotary_store_expected(scaled, heads, kv_heads, cos, sin, kv, slots)
    keep = slots >= 0
    rotary_store_(qkv, heads, kv_heads, cos, sin, kv, slots, stream, 1e-6, qk_norm=norms)
    _close(qkv[:, :heads], want_q, dtype)
    _close(kv, want_kv, dtype)
    untouched = torch.ones(2 * 4 * 16, dtype=torch.bool)
    untouched[slots[keep].cpu()] = False
    untouched[(slots[keep] + 64).cpu()] = False
    assert torch.equal(kv.double().view(-1, kv_heads, head_dim)[untouched.to(device)],
                       want_kv.view(-1, kv_heads, head_dim)[untouched.to(device)])




def check_varlen(device, dtype, heads, kv_heads, head_dim, chunks, window=None, block_size=16,
                 seed=0, softcap=None):
    """Varlen paged attention: chunks [(start, rows)] (a chunk attends to keys 0..start + rows - 1,
    causally) against a float64 computation from the gathered keys."""
    from hsserve.kernels.paged_prefill_attention import paged_varlen_attention, varlen_metadata

    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = 2 + sum(-(-(s + n) // block_size) for s, n in chunks)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, head_dim, generator=g).to(device, dtype)
    if softcap:
        q = q * 8
    spec, row, used = [], 0, 0
    for s, n in chunks:
        pages = -(-(s + n) // block_size)
        spec.append((row, n, s, perm[used : used + pages]))
        row += n
        used += pages
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    vb = varlen_metadata(spec, heads // kv_heads, torch.device(device))
    paged_varlen_attention(q, kv, vb, scale, window, out=out, softcap=softcap)
    assert not torch.isnan(out).any(), "every row must be written"
    ref = torch.empty(q.shape, dtype=torch.float64)
    kv64 = kv.double().cpu()
    for r0, n, s, table in spec:
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(s + n)])
        k = kv64[0].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        v = kv64[1].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, 1)
        for i in range(n):
            p = s + i
            keys = torch.arange(s + n)
            vis = keys <= p
            if window:
                vis &= keys > p - window
            att = torch.einsum("hd,khd->hk", q[r0 + i].double().cpu(), k) * scale
            if softcap:
                att = torch.tanh(att / softcap) * softcap
            att = att.masked_fill(~vis[None], float("-inf")).softmax(-1)
            ref[r0 + i] = torch.einsum("hk,khd->hd", att, v)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), float(err)


def check_argmax(device, rows, vocab, seed=0):
    """The two-pass argmax equals torch's, ties (lowest index wins) and all -inf rows included."""
    from hsserve.kernels.argmax import argmax_triton

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if rows > 1:
        x[1, [vocab - 1, 7, vocab // 2]] = 50.0  # NOTE: a tie across slices: index 7 wins
    if rows > 2:
        x[2] = float("-inf")
    x = x.to(device)
    assert torch.equal(argmax_triton(x), x.argmax(dim=-1))
    buf = torch.full((rows + 2,), -1, dtype=torch.int64, device=device)
    assert argmax_triton(x, out=buf[1 : rows + 1]).data_ptr() == buf[1:].data_ptr()
    assert torch.equal(buf[1 : rows + 1], x.argmax(dim=-1)), "written into the given out"
    assert buf[0] == -1 and buf[-1] == -1, "nothing written outside out"
    host = torch.full((3, rows + 1), -1, dtype=torch.int64, pin_memory=device == "cuda")
    slot = torch.tensor(1, device=device)
    argmax_triton(x, out=buf[1 : rows + 1], host=(host, slot))
    assert torch.equal(host[1, :rows], x.argmax(dim=-1).cpu()), "the host slot the device names"
    assert (host[0] == -1).all() and (host[2] == -1).all() and host[1, rows] == -1, \
        "nothing written to the host outside that slot's rows"
    # the logsumexp and the argmax's log-probability, on the device and in the host slot
    lse = torch.full((rows + 1,), -1.0, device=device)
    host_lp = torch.full((2, 2, rows + 1), -1.0, pin_memory=device == "cuda")
    argmax_triton(x, out=buf[1 : rows + 1], host=(host, slot), lse=(lse[:rows], host_lp))
    want = torch.logsumexp(x, dim=-1)
    finite = want.isfinite()
    # NOTE: on the GPU the kernel's exp / log are the hardware's approximations (ex2 / lg2)
    assert (lse[:rows][finite] - want[finite]).abs().max() <= 5e-4 and lse[rows] == -1
    got = host_lp[1, :, :rows].to(device)
    assert (got[1][finite] - want[finite]).abs().max() <= 5e-4
    assert (got[0][finite] - (x.max(dim=-1).values - want)[finite]).abs().max() <= 5e-4
    assert (host_lp[0] == -1).all() and (host_lp[1, :, rows] == -1).all()
    if rows > 2:
        assert got[1, 2] == float("-inf"), "an all -inf row's logsumexp"


def check_topk_logprobs(device, rows, vocab, k, seed=0):
    """The two-pass top-k equals torch's: ids exactly (ties: the lowest id), log-probabilities to
    rounding; a row whose top values tie across slices; a row mostly -inf."""
    import triton

    from hsserve.kernels.topk import split_topk, topk_logprobs, topk_logprobs_ref, topk_logprobs_triton

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if rows > 1:
        x[1, [vocab - 1, 9, vocab // 2, 3]] = 40.0  # NOTE: four-way tie: 3, 9, vocab // 2, vocab - 1
    if rows > 2:
        x[2, : vocab - 2] = float("-inf")
    x = x.to(device)
    lse = torch.logsumexp(x, dim=-1)
    full = topk_logprobs_triton(x, lse, triton.next_power_of_2(k))
    if device == "cuda":
        assert torch.equal(topk_logprobs(x, lse, k), full)
    (ids, vals), (want_ids, want_vals) = split_topk(full), split_topk(topk_logprobs_ref(x, lse, k))
    got = torch.cat([ids[:, :k].float(), vals[:, :k]], dim=1)
    want = torch.cat([want_ids.float(), want_vals], dim=1)
    live = want[:, k:].isfinite()
    plain = torch.ones(rows, dtype=torch.bool)
    plain[1:3] = False  # NOTE: torch's order among ties is unspecified
    assert torch.equal(got[plain, :k], want[plain, :k])
    assert (got[:, k:][live] - want[:, k:][live]).abs().max() <= 1e-5
    if rows > 1:
        assert got[1, : min(k, 4)].tolist() == [3.0, 9.0, float(vocab // 2), float(vocab - 1)][:k]
    if rows > 2 and k >= 2:
        assert got[2, :2].tolist() == sorted([float(vocab - 2), float(vocab - 1)],
                                             key=lambda i: -x[2, int(i)].item())


def check_embed_rotary(device, dtype, rows, hidden, head_dim, seed=0):
    """The embedding rows (exactly) and the rotary cos / sin (float32, to rounding) of the
    reference, positions up to 100k; hidden not a power of two."""
    from hsserve.kernels.elementwise import embed_rotary_ref, embed_rotary_triton
    from hsserve.models.rope import inverse_frequencies

    g = torch.Generator(device="cpu").manual_seed(seed)
    embed = torch.randn(50, hidden, generator=g).to(device, dtype)
    ids = torch.randint(0, 50, (rows,), generator=g).to(device)
    positions = torch.randint(0, 100_000, (rows,), generator=g).to(device)
    inv_freq = inverse_frequencies(head_dim, {"rope_theta": 500000.0}).to(device)
    got, want = (f(ids, positions, embed, inv_freq) for f in (embed_rotary_triton,
                                                             embed_rotary_ref))
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == torch.float32 and a.shape == (rows, head_dim // 2)
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0)


def check_gemv(device, dtype, rows, n, k, seed=0):
    """gemv equals F.linear in float64, alone and added into a given output; odd N and K (padded
    rows, N not a multiple of the preferred block)."""
    from hsserve.kernels.gemv import gemv, gemv_ref

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    base = torch.randn(rows, n, generator=g).to(device, dtype)
    ref = gemv_ref(x.double(), w.double())
    _close(gemv(x, w), ref, dtype)
    _close(gemv(x, w, into=base.clone()), gemv_ref(x.double(), w.double(), into=base.double()),
           dtype)
    # the final norm folded in (its weight apart from W), float32 logits written
    from hsserve.kernels.elementwise import add_rmsnorm_ref

    nw = (1 + torch.randn(k, generator=g) / 4).to(device, dtype)
    normed, _ = add_rmsnorm_ref((3 * x).double(), None, nw.double(), 1e-5)
    out = torch.full((rows, n + 1), -1.0, device=device)
    got = gemv(3 * x, w, out=out[:, :n], norm=(nw, 1e-5))
    assert got.data_ptr() == out.data_ptr() and (out[:, n] == -1).all()
    _close(got, gemv_ref(normed, w.double()), dtype)


def check_gemv_silu_mul(device, dtype, rows, inter, k, rms, seed=0):
    """The fused gate_up GEMV + SiLU-and-mul equals the reference product then silu_mul_ref (with
    the rows' 1 / rms when rms)."""
    from hsserve.kernels.elementwise import silu_mul_ref
    from hsserve.kernels.gemv import gemv_ref, gemv_silu_mul

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 3).to(device, dtype)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(device, dtype)
    ref = silu_mul_ref(gemv_ref(x.double(), w.double()), x.double() if rms else None, 1e-5)
    _close(gemv_silu_mul(x, w, 1e-5 if rms else None), ref, dtype)


def check_gemv_rotary_store(device, dtype, heads, kv_heads, head_dim, k, rms, seed=0,
                            qk_norm=False):
    """The fused qkv GEMV + rotary + cache writes equals the reference product, then rotary_ref
    and write_kv (with x's 1 / rms first when rms); a negative slot writes nothing. qk_norm:
    gemv_head_norm_store (each head RMS-normed first by its last program; its tickets zero again
    after each launch)."""
    from hsserve.kernels.elementwise import rms_inverse_ref
    from hsserve.kernels.gemv import gemv_ref, gemv_rotary_store
    from hsserve.kernels.gemv_head_norm import gemv_head_norm_store

    g = torch.Generator(device="cpu").manual_seed(seed)
    n = (heads + 2 * kv_heads) * head_dim
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    qw, kw = (1 + 0.3 * torch.randn(2, head_dim, generator=g)).to(device, dtype)
    tickets = torch.zeros(heads + 2 * kv_heads, dtype=torch.int32, device=device)
    for slot, pos in ((17, 700.0), (-1, 3.0), (63, 5000.0)):
        x = (3 * torch.randn(1, k, generator=g)).to(device, dtype)
        kv = torch.randn(2, 4, 16, kv_heads, head_dim, generator=g).to(device, dtype)
        slots = torch.tensor([slot], device=device)
        cos, sin = _rope([pos], head_dim, device)
        qkv = gemv_ref(x.double(), w.double()).view(1, -1, head_dim)
        if rms:
            qkv = qkv * rms_inverse_ref(x.double(), 1e-5)[:, :, None]
        if qk_norm:
            _qk_normed(qkv, qw, kw, heads, kv_heads)
        want_q, want_kv = _rotary_store_expected(qkv, heads, kv_heads, cos, sin, kv, slots)
        eps = 1e-5 if rms else None
        if qk_norm:
            q = gemv_head_norm_store(x, w, heads, kv_heads, cos, sin, kv, slots, (qw, kw, 1e-6),
                                     tickets, eps)
            assert tickets.tolist() == [0] * len(tickets)
        else:
            q = gemv_rotary_store(x, w, heads, kv_heads, cos, sin, kv, slots, eps)
        _close(q, want_q, dtype)
        if slot < 0:
            assert torch.equal(kv.double(), want_kv)
        _close(kv, want_kv, dtype)


def check_token_logprob(device, rows, vocab, seed=0):
    """The one-pass kernel equals the torch reference: log-probability and logsumexp to
    rounding, the rank exactly (ties with the chosen logit do not count)."""
    from hsserve.kernels.token_logprob import token_logprob_ref, token_logprob_triton

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(device)
    tokens = torch.randint(0, vocab, (rows,), generator=g).to(device)
    if rows > 1:
        x[1, tokens[1]] = x[1].max() + 1  # NOTE: the most likely: rank 1
    if rows > 2:
        x[2, : vocab // 2] = float("-inf")  # NOTE: a masked half (min_tokens-like)
        tokens[2] = vocab - 1
    got, want = token_logprob_triton(x, tokens), token_logprob_ref(x, tokens)
    # NOTE: on the GPU the kernel's exp / log are the hardware's approximations (ex2 / lg2)
    diff = (got[:, [0, 2]] - want[:, [0, 2]]).abs().max().item()
    assert diff <= 5e-4, (diff, got, want)
    assert torch.equal(got[:, 1], want[:, 1])
    if rows > 1:
        assert got[1, 1] == 1


def check_moe(device, dtype, tokens, experts, k, hidden, inter, seed=0, configs=(None, None)):
    """The grouped expert GEMM (gate_up's and down's launch configs given or gemm_config's) equals
    the reference's float64 result (float32 weights either way: Mixtral's), every token routed to
    k distinct experts, some experts unused; `into` adds the same rows into a stream."""
    from hsserve.kernels.moe import experts_ref, fused_experts

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, -1] = -1e9  # NOTE: the last expert is never chosen
    weights, chosen = torch.topk(logits.softmax(-1), k)
    ref = experts_ref(x.double(), gate_up.double(), down.double(), weights.double(), chosen, True)
    args = (*(t.to(device, dtype) for t in (x, gate_up, down)), weights.to(device),
            chosen.to(device), True)
    got = fused_experts(*args, configs=configs)
    _close(got.cpu(), ref, dtype, fp32_tol=1e-5)
    stream = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    into = fused_experts(*args, configs=configs, into=stream.clone())  # NOTE: added in place
    assert torch.equal(into, (stream.float() + got.float()).to(dtype))


def check_one_token_experts(device, dtype, experts, hidden, inter, k, renormalize, seed=0):
    """one_token_experts (gate_up's programs route the token from its float64 logits) equals
    route_align's routing through fused_experts bit for bit, alone and added `into` a stream;
    two identical router rows (a tie) both chosen, in route_align's order."""
    from hsserve.kernels.moe import fused_experts, one_token_experts
    from hsserve.kernels.moe_route import route_align, router_logits

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, hidden, generator=g)
    w = torch.randn(experts, hidden, generator=g) / hidden**0.5
    w[2] = w[1] = x[0] / x[0].norm()  # NOTE: the largest logits, tied
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    x, w, gate_up, down = (t.to(device, dtype) for t in (x, w, gate_up, down))
    logits = router_logits(x, w)
    weights, chosen, _, _ = route_align(logits, k, renormalize, 16)
    assert chosen[0, :2].tolist() == [1, 2]
    want = fused_experts(x, gate_up, down, weights, chosen, True)
    got = one_token_experts(x, logits, gate_up, down, k, renormalize)
    assert torch.equal(got, want)
    stream = torch.randn(1, hidden, generator=g).to(device, dtype)
    into = one_token_experts(x, logits, gate_up, down, k, renormalize, into=stream.clone())
    assert torch.equal(into, (stream.float() + got.float()).to(dtype))


def check_router_logits(device, dtype, tokens, experts, hidden, seed=0, block_e=None):
    """router_logits equals F.linear in float64 (to float64 rounding); identical router rows tie
    exactly (in one program's tile and across programs); a row's logits are the same bits alone
    and in a batch, at any place in it."""
    from hsserve.kernels.moe_route import router_logits

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(dtype)
    w[1] = w[0]
    w[experts - 1] = w[0]  # NOTE: ties inside a tile and across tiles
    got = router_logits(x.to(device), w.to(device), block_e=block_e).cpu()
    want = torch.nn.functional.linear(x.double(), w.double())
    assert got.dtype == torch.float64
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item()
    assert torch.equal(got[:, 0], got[:, 1]) and torch.equal(got[:, 0], got[:, experts - 1])
    last = router_logits(x[-1:].to(device), w.to(device), block_e=block_e).cpu()
    assert torch.equal(last[0], got[-1])


def check_route_align(device, tokens, experts, k, renormalize, seed=0, num_warps=None):
    """route_align's routing equals MoE.route's (softmax of float64 logits, top k, renormalized
    or not; a tie goes to the lower expert) and its alignment align_pairs' (same groups)."""
    from hsserve.kernels.moe import align_pairs
    from hsserve.kernels.moe_route import route_align

    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
    logits[0, 1] = logits[0, 0]  # NOTE: a tie
    w, e, ids, blocks = route_align(logits.to(device), k, renormalize, 16, num_warps)
    probs = torch.softmax(logits, dim=-1).float()
    ref_w, ref_e = torch.topk(probs, k, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert torch.equal(e.cpu().sort(-1).values, ref_e.sort(-1).values)
    assert torch.allclose(w.cpu().sort(-1).values, ref_w.sort(-1).values, rtol=1e-6)
    ref_ids, ref_blocks = align_pairs(e.cpu(), experts, 16)
    assert torch.equal(blocks.cpu(), ref_blocks)
    assert torch.equal(ids.cpu(), ref_ids)  # NOTE: both keep the pairs' order within a group


def check_decode_route(device, dtype, tokens, experts, hidden, k, renormalize, seed=0):
    """decode_route equals router_logits then route_align (bit for bit); with norm_eps the router
    norms the stream itself: its normed rows are add_rmsnorm's with a weight of ones (to a
    rounding of the scale) and its routing is that of those rows."""
    from hsserve.kernels.elementwise import add_rmsnorm_ref
    from hsserve.kernels.moe_route import decode_route, route_align, router_logits

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (3 * torch.randn(tokens, hidden, generator=g)).to(device, dtype)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w[1] = w[0]  # NOTE: a tie
    for norm_eps in (None, 1e-6):
        rows, got = decode_route(x, w, k, renormalize, 16, norm_eps=norm_eps)
        want = route_align(router_logits(rows, w), k, renormalize, 16)
        for a, b in zip(got, want):  # NOTE: weights, experts, pair ids, blocks
            assert torch.equal(a, b)
        if norm_eps is not None:
            ref = add_rmsnorm_ref(x.double(), None, torch.ones(hidden, dtype=torch.float64,
                                                               device=device), norm_eps)[0]
            _close(rows, ref, dtype)


def check_bitmask(device: str) -> None:
    """The guided-decoding mask kernel equals bitmask_ref, odd vocabulary sizes included."""
    from hsserve.kernels.bitmask import apply_bitmask_triton, bitmask_ref

    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((3, 49152), (2, 1000), (1, 37)):
        logits = torch.randn(rows, vocab, generator=g).to(device)
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32,
                                generator=g).to(device)
        bitmask[0] = -1
        out = apply_bitmask_triton(logits, bitmask)
        assert torch.equal(out, bitmask_ref(logits, bitmask)), (rows, vocab)
        assert torch.equal(out[0], logits[0])
