"""The CPU's compiled kernels (kernels/cpu_ops.py) match their torch references, float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hsserve.kernels import cpu_ops
from hsserve.kernels.elementwise import add_rmsnorm_ref, silu_mul_ref
from hsserve.kernels.paged_attention_ref import paged_attention_ref, write_kv
from hsserve.models.attention_batch import AttentionBatch
from hsserve.models.rope import apply_rotary


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ops.library() is not None, "the set-up installs g++; the library must build here"


def _paged(seqs: int, kv_heads: int, head_dim: int, block: int, lens: list[int], seed: int):
    """A cache with each sequence's blocks scattered, its tables and lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in lens]
    blocks = sum(need) + 7
    kv = torch.randn(2, blocks, block, kv_heads, head_dim, generator=g)
    order = torch.randperm(blocks, generator=g)[: sum(need)].tolist()
    width = max(need)
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n] + [0] * (width - n))
        at += n
    return kv, torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def _reference(q, kv, tables, lens, scale, window, softcap):
    block = kv.shape[2]
    keys = torch.arange(tables.shape[1] * block)
    mask = keys[None, :] < lens[:, None]
    if window is not None:
        mask &= keys[None, :] > lens[:, None] - 1 - window
    bias = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    batch = AttentionBatch(slot_mapping=torch.zeros(len(q), dtype=torch.long),
                           decode_rows=torch.arange(len(q)), decode_block_tables=tables,
                           decode_bias=bias, decode_seq_lens=lens)
    return paged_attention_ref(q, kv, batch, scale, softcap)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block", [
    (9, 3, 64, 16), (8, 8, 32, 16), (4, 1, 128, 32), (6, 2, 80, 16), (2, 2, 6, 4)])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 2.0)])
def test_decode_attention_matches_reference(heads, kv_heads, head_dim, block, window, softcap):
    # sequences of one key, a block's edge and past two chunks of 32; windows and Gemma 2's cap
    lens = [1, block, block + 1, 70, 33]
    kv, tables, lens_t = _paged(len(lens), kv_heads, head_dim, block, lens, seed=heads)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1)) * 3
    scale = head_dim ** -0.5
    ref = _reference(q, kv, tables, lens_t, scale, window, softcap)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = cpu_ops.decode_attention(q, kv, tables, lens_t, scale, window, softcap)
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    torch.set_num_threads(2)


def test_decode_attention_reads_strided_queries():
    # q as the decoder passes it: the first heads of a fused qkv row
    kv, tables, lens = _paged(3, 2, 16, 8, [5, 9, 20], seed=3)
    qkv = torch.randn(3, 4 + 2 * 2, 16)
    q = qkv[:, :4]
    out = cpu_ops.decode_attention(q, kv, tables, lens, 0.25, None, None)
    ref = _reference(q.contiguous(), kv, tables, lens, 0.25, None, None)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (2, 1, 6)])
def test_rotary_store_matches_reference(heads, kv_heads, head_dim):
    t = 7
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim)
    angles = torch.randn(t, head_dim // 2) * 50
    cos, sin = (torch.cat((f, f), dim=-1) for f in (angles.cos(), angles.sin()))
    kv = torch.zeros(2, 6, 4, kv_heads, head_dim)
    kv_ref = kv.clone()
    slots = torch.tensor([3, 0, 17, 9, 22, 5, 1])
    rotated = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
    write_kv(kv_ref, rotated[:, heads:], qkv[:, heads + kv_heads:], slots)
    out = qkv.clone()
    cpu_ops.rotary_store_(out, heads, kv_heads, cos, sin, kv, slots)
    assert torch.equal(out[:, :heads], rotated[:, :heads])  # NOTE: the same roundings
    assert torch.equal(kv, kv_ref)


def test_silu_mul_matches_reference():
    x = torch.randn(5, 2 * 1000) * 30  # NOTE: far into both tails of the sigmoid
    out = cpu_ops.silu_mul(x)
    ref = silu_mul_ref(x.double()).float()
    assert torch.allclose(out, ref, rtol=3e-6, atol=1e-30)


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_mask_logits_matches_reference(vocab):
    from hsserve.kernels.bitmask import bitmask_ref

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=g)
    bitmask[0] = -1  # NOTE: every token allowed: the logits unchanged
    out = cpu_ops.mask_logits(logits, bitmask)
    assert torch.equal(out, bitmask_ref(logits, bitmask))
    assert torch.equal(out[0], logits[0]) and torch.isinf(out[1:]).any()

@pytest.mark.parametrize("residual", [False, True])
def test_add_rmsnorm_matches_reference(residual):
    x, r = torch.randn(6, 576) * 40, torch.randn(6, 576)
    w = torch.randn(576)
    out, total = cpu_ops.add_rmsnorm(x, r if residual else None, w, 1e-5)
    ref, ref_total = add_rmsnorm_ref(x.double(), r.double() if residual else None, w.double(),
                                     1e-5)
    assert torch.allclose(out, ref.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(total, (x + r) if residual else x)


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")])
def test_narrower_vector_paths_agree(flags, tmp_path, monkeypatch):
    # the AVX2 and plain C++ dot products (machines without AVX-512) against the reference
    try:
        lib = cpu_ops.load(cpu_ops.build(str(tmp_path), flags))
    except RuntimeError as e:
        pytest.skip(f"this compiler cannot target {flags}: {e}")
    monkeypatch.setattr(cpu_ops, "library", lambda: lib)
    kv, tables, lens = _paged(4, 2, 80, 16, [1, 16, 40, 70], seed=5)
    q = torch.randn(4, 6, 80)
    ref = _reference(q, kv, tables, lens, 0.1, None, None)
    out = cpu_ops.decode_attention(q, kv, tables, lens, 0.1, None, None)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    x, w = torch.randn(3, 100), torch.randn(100)
    normed, _ = cpu_ops.add_rmsnorm(x, None, w, 1e-6)
    assert torch.allclose(normed, add_rmsnorm_ref(x, None, w, 1e-6)[0], rtol=1e-5, atol=1e-5)
    x, w, b = torch.randn(5, 70), torch.randn(100, 70), torch.randn(100)
    y = cpu_ops.gemm(x, cpu_ops.pack_weight(w), 100, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows, n, k", [(1, 5, 3), (8, 96, 64), (13, 100, 70), (32, 960, 576),
                                        (40, 49, 1536), (0, 10, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_linear(rows, n, k, bias):
    # N past a panel's 48 columns, row blocks of 8 with a remainder, K of every layer shape
    g = torch.Generator().manual_seed(rows + n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g) if bias else None
    wide = torch.randn(rows, k + 5, generator=g)
    x = wide[:, 2:k + 2]  # NOTE: rows strided past K: read in place
    packed = cpu_ops.pack_weight(w)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y = cpu_ops.gemm(x, packed, n, b)
        ref = F.linear(x.double(), w.double(), b.double() if bias else None)
        assert y.shape == (rows, n)
        if rows:
            assert (y - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max())
    torch.set_num_threads(2)


def test_gemm_rows_do_not_depend_on_the_batch():
    # each output is one FMA chain over k: a row alone and in any batch gives the same bits
    w, x = torch.randn(200, 96), torch.randn(32, 96)
    packed = cpu_ops.pack_weight(w)
    full = cpu_ops.gemm(x, packed, 200, None)
    for i, rows in ((0, 1), (3, 5), (9, 23)):
        assert torch.equal(cpu_ops.gemm(x[i:i + rows], packed, 200, None), full[i:i + rows])


def test_pack_for_cpu_packs_for_the_compiled_product():
    from hsserve.models.linear import Linear, pack_for_cpu

    model = torch.nn.Module()
    model.a, model.b = Linear(32, 64), Linear(64, 16, bias=True)
    for m in (model.a, model.b):
        torch.nn.init.normal_(m.weight)
    torch.nn.init.normal_(model.b.bias)
    dense = {m: m.weight.detach().clone() for m in (model.a, model.b)}
    assert pack_for_cpu(model)
    x = torch.randn(3, 32)
    for m in (model.a, model.b):
        assert m.weight is None and m.compiled is not None, "the packed copy replaces the weight"
    h = model.a(x)
    torch.testing.assert_close(h, F.linear(x, dense[model.a]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.b(h), F.linear(h, dense[model.b], model.b.bias),
                               rtol=1e-5, atol=1e-5)


def test_build_is_keyed_and_reused(tmp_path):
    path = cpu_ops.build(str(tmp_path))
    assert path.startswith(str(tmp_path)) and cpu_ops.build(str(tmp_path)) == path
    assert [p.name for p in (tmp_path / "cpu_ops").iterdir()] == [path.rsplit("/", 1)[1]]


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_engine_with_and_without_the_library_agree(family, tiny_model_dir, monkeypatch):
    # the switch end to end: windows past their 24 keys, Gemma 2's capping, batched decode
    from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

    prompts = [list(range(100, 100 + n)) for n in (5, 30, 41)]

    def run():
        engine = Engine(EngineConfig(model=tiny_model_dir(family), device="cpu")).start()
        try:
            assert engine.executor.plan.cpu_kernels == (cpu_ops.library() is not None)
            sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            streams = [engine.submit(GenerationRequest(
                f"r{i}", prompt_ids=p, sampling=sp, hidden_mode=HiddenStatesMode.FULL,
                hidden_layers=(1, -1))) for i, p in enumerate(prompts)]
            return [s.result() for s in streams]
        finally:
            engine.shutdown()

    compiled = run()
    monkeypatch.setattr(cpu_ops, "library", lambda: None)
    plain = run()
    for a, b in zip(compiled, plain):
        assert a.token_ids == b.token_ids
        assert (a.hidden - b.hidden).abs().max() <= 1e-5 * b.hidden.abs().max()
