"""On CUDA (pytest -m gpu): the Triton kernels match their torch references.

Triton kernels against the torch reference on CUDA: random inputs, odd lengths, block
boundaries, long contexts, the model dtypes (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import check_bitmask, check_decode, check_write_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENS = [1, 15, 16, 17, 31, 33, 257, 1000, 3001, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (32, 8, 128), (9, 3, 64), (8, 8, 128)])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim):
    for seed, splits in enumerate([None, 1, 7]):
        check_decode("cuda", dtype, heads, kv_heads, head_dim, LENS, num_splits=splits, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_one_row(dtype, head_dim):
    # batch 1 (PDL: the first tile read before the wait): contexts within one 64-key tile, at
    # its edge, over a few tiles (fewer splits than asked), long
    for length in [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 5000]:
        for splits in [None, 1, 3]:
            check_decode("cuda", dtype, 32, 8, head_dim, [length], num_splits=splits)
        check_decode("cuda", dtype, 32, 8, head_dim, [length], window=100)


def test_decode_attention_sliding_window_and_big_batch():
    check_decode("cuda", torch.bfloat16, 32, 8, 128, [4096 - i * 37 for i in range(64)], window=1000)
    check_decode("cuda", torch.float32, 16, 4, 64, list(range(1, 257)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_padding_slots(dtype):
    check_write_kv("cuda", dtype, kv_heads=8, head_dim=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden, inter", [(576, 1536), (2048, 8192), (4096, 14336)])
def test_elementwise_kernels_match_reference(dtype, hidden, inter):
    from kernel_cases import check_elementwise

    check_elementwise("cuda", dtype, rows=5, hidden=hidden, inter=inter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (32, 8, 128), (9, 3, 64)])
def test_rotary_store_matches_reference(dtype, heads, kv_heads, head_dim):
    from kernel_cases import check_rotary_store

    for rms, qk_norm in ((False, False), (True, False), (False, True)):
        check_rotary_store("cuda", dtype, heads, kv_heads, head_dim, rms=rms, qk_norm=qk_norm)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 8, 64), (32, 8, 128), (9, 3, 64), (8, 8, 128)])
def test_varlen_attention_matches_reference(dtype, heads, kv_heads, head_dim):
    from kernel_cases import check_varlen

    # fresh prompts, chunks after cached prefixes, decode rows, block edges, a long context
    check_varlen("cuda", dtype, heads, kv_heads, head_dim,
                 [(0, 300), (1000, 70), (5, 1), (0, 1), (2000, 1), (17, 33), (0, 16)])


def test_varlen_attention_sliding_window():
    from kernel_cases import check_varlen

    check_varlen("cuda", torch.bfloat16, 32, 8, 128, [(0, 700), (1500, 40), (900, 1)], window=512)


@pytest.mark.parametrize("dtype, rows, hidden, head_dim", [(torch.bfloat16, 1, 2048, 64),
                                                            (torch.float32, 300, 576, 64)])
def test_embed_rotary_matches_reference(dtype, rows, hidden, head_dim):
    from kernel_cases import check_embed_rotary

    check_embed_rotary("cuda", dtype, rows, hidden, head_dim)


@pytest.mark.parametrize("rows, vocab", [(1, 128256), (3, 49152), (64, 128256), (5, 1000)])
def test_token_logprob_matches_reference(rows, vocab):
    from kernel_cases import check_token_logprob

    check_token_logprob("cuda", rows, vocab)


@pytest.mark.parametrize("rows, vocab, k", [(1, 128256, 5), (3, 49152, 20), (64, 128256, 8),
                                           (5, 1000, 3)])
def test_topk_logprobs_matches_torch(rows, vocab, k):
    from kernel_cases import check_topk_logprobs

    check_topk_logprobs("cuda", rows, vocab, k)


@pytest.mark.parametrize("rows, vocab", [(1, 128256), (3, 49152), (64, 128256), (5, 1000)])
def test_argmax_matches_torch(rows, vocab):
    from kernel_cases import check_argmax

    check_argmax("cuda", rows, vocab)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, n, k", [(1, 3072, 2048), (1, 2048, 8192), (1, 4096, 14336),
                                        (1, 1000, 576), (1, 96, 64), (1, 7, 33)])
def test_gemv_matches_reference(dtype, rows, n, k):
    from kernel_cases import check_gemv

    if dtype == torch.float32 and k > 8192:
        pytest.skip("a float32 row over 32 KB goes to cuBLAS")
    check_gemv("cuda", dtype, rows, n, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter, k, rms", [(8192, 2048, True), (14336, 4096, False),
                                           (1536, 576, True), (40, 200, False)])
def test_gemv_silu_mul_matches_reference(dtype, inter, k, rms):
    from kernel_cases import check_gemv_silu_mul

    check_gemv_silu_mul("cuda", dtype, 1, inter, k, rms)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim, k, rms, qk_norm", [
    (32, 8, 64, 2048, True, False), (32, 8, 128, 4096, False, False), (9, 3, 64, 576, True, False),
    (32, 4, 128, 2048, True, True), (16, 8, 128, 4096, False, True), (8, 2, 64, 1024, True, True)])
def test_gemv_rotary_store_matches_reference(dtype, heads, kv_heads, head_dim, k, rms, qk_norm):
    # qk_norm: gemv_head_norm_store (Qwen3-30B-A3B's attention with its folded norm first)
    from kernel_cases import check_gemv_rotary_store

    check_gemv_rotary_store("cuda", dtype, heads, kv_heads, head_dim, k, rms, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, k, hidden, inter", [
    (1, 128, 8, 2048, 768), (5, 8, 2, 256, 200), (64, 128, 8, 512, 768), (600, 8, 2, 256, 96)])
def test_moe_grouped_gemm_matches_reference(dtype, tokens, experts, k, hidden, inter):
    # batch 1 of the Qwen3-30B-A3B shape, odd sizes, a decode batch, prefill (64-row blocks)
    from kernel_cases import check_moe

    check_moe("cuda", dtype, tokens, experts, k, hidden, inter)


def test_moe_grouped_gemm_launch_configs():
    # launches other than gemm_config's at batch 1 and 16 of the Qwen3-30B-A3B shape (fewer
    # experts: a smaller reference)
    from hsserve.kernels.moe import GemmConfig
    from kernel_cases import check_moe

    for cfg in (GemmConfig(16, 128, 4, 4), GemmConfig(32, 256, 8, 3), GemmConfig(64, 64, 4, 3),
                GemmConfig(16, 64, 2, 5)):
        for tokens in (1, 16):
            check_moe("cuda", torch.bfloat16, tokens, 32, 8, 2048, 768, configs=(cfg, cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, hidden", [(1, 128, 2048), (16, 128, 2048), (9, 8, 4096),
                                                     (3, 6, 200)])
def test_moe_router_logits_matches_float64(dtype, tokens, experts, hidden):
    # Qwen3-30B-A3B at batch 1 and 16, Mixtral's 8 x 4096, odd sizes
    from kernel_cases import check_router_logits

    for block_e in (None, 1, 4):
        check_router_logits("cuda", dtype, tokens, experts, hidden, block_e=block_e)


@pytest.mark.parametrize("tokens, experts, k, renormalize", [(1, 128, 8, True), (16, 128, 8, True),
                                                             (7, 8, 2, False), (5, 6, 3, True),
                                                             (1, 8, 2, False), (1, 60, 4, True),
                                                             (4, 128, 8, False), (64, 128, 8, True),
                                                             (37, 60, 4, False), (256, 8, 2, True)])
def test_moe_route_align_matches_reference(tokens, experts, k, renormalize):
    from kernel_cases import check_route_align

    # NOTE: 1 or 2 warps over thousands of logits only spill (and take minutes to compile)
    for warps in (None, 1, 2, 8, 16) if tokens * experts <= 2048 else (None, 8, 16):
        check_route_align("cuda", tokens, experts, k, renormalize, num_warps=warps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, hidden, k, renormalize", [
    (2, 128, 2048, 8, False), (2, 8, 4096, 2, True), (3, 60, 200, 4, True), (5, 128, 2048, 8, True),
    (64, 128, 2048, 8, True), (48, 8, 4096, 2, False)])
def test_moe_decode_route_matches_router_then_route_align(dtype, tokens, experts, hidden, k,
                                                          renormalize):
    # Qwen3-30B-A3B, Mixtral, odd sizes at a few tokens up to a decode graph's 64 (one token:
    # one_token_experts')
    from kernel_cases import check_decode_route

    check_decode_route("cuda", dtype, tokens, experts, hidden, k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, hidden, inter, k, renormalize", [
    (128, 2048, 768, 8, True), (8, 4096, 512, 2, True), (60, 200, 40, 4, False)])
def test_moe_one_token_experts_route_in_gate_up(dtype, experts, hidden, inter, k, renormalize):
    # Qwen3-30B-A3B, Mixtral (a narrower expert), odd sizes
    from kernel_cases import check_one_token_experts

    check_one_token_experts("cuda", dtype, experts, hidden, inter, k, renormalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
def test_attention_kernels_soft_cap(dtype, window):
    # Gemma 2's capping in both attention kernels (its decode graphs and prefill)
    from kernel_cases import check_varlen

    for splits in (None, 1, 3):
        check_decode("cuda", dtype, 8, 4, 256, [1, 17, 50, 300], window=window, num_splits=splits,
                     softcap=50.0)
    check_varlen("cuda", dtype, 8, 4, 256, [(0, 37), (32, 5), (0, 1)], window=window, softcap=50.0)


def test_guided_bitmask_kernel_matches_reference():
    check_bitmask("cuda")
