"""The Triton kernels match their torch references on the CPU, through Triton's interpreter.

Triton kernels against the torch reference, on the CPU through Triton's interpreter (the GPU
run of the same checks is tests/gpu/test_gpu_kernels.py)."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_cases import check_bitmask, check_decode, check_write_kv

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter run is for CPU-only machines",
)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_attention_matches_reference(heads, kv_heads, head_dim, splits):
    # lengths at and around block boundaries, a single token, an empty (padding) row
    check_decode("cpu", torch.float32, heads, kv_heads, head_dim, [1, 15, 16, 17, 50, 0],
                 num_splits=splits)


@pytest.mark.parametrize("length", [1, 16, 64, 65, 200, 600])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_attention_one_row(length, splits):
    # a split takes one 64-key tile at least: a context within it is the first split's alone
    # (no merge), a longer one spreads over fewer splits than asked
    check_decode("cpu", torch.float32, 8, 2, 32, [length], num_splits=splits)
    check_decode("cpu", torch.float32, 8, 2, 32, [length], window=50, num_splits=splits)


def test_decode_attention_sliding_window():
    check_decode("cpu", torch.float32, 8, 2, 32, [5, 40, 70], window=24, num_splits=2)


def test_write_kv_skips_padding_slots():
    check_write_kv("cpu", torch.float32)


def test_elementwise_kernels_match_reference():
    from kernel_cases import check_elementwise

    check_elementwise("cpu", torch.float32)


@pytest.mark.parametrize("rms, qk_norm", [(False, False), (True, False), (False, True)])
def test_rotary_store_matches_reference(rms, qk_norm):
    from kernel_cases import check_rotary_store

    check_rotary_store("cpu", torch.float32, rms=rms, qk_norm=qk_norm)


@pytest.mark.parametrize("rows, n, k", [(1, 96, 64), (1, 40, 200), (1, 7, 33)])
def test_gemv_matches_reference(rows, n, k):
    from kernel_cases import check_gemv

    check_gemv("cpu", torch.float32, rows, n, k)


@pytest.mark.parametrize("inter, k, rms", [(48, 64, False), (40, 200, True)])
def test_gemv_silu_mul_matches_reference(inter, k, rms):
    from kernel_cases import check_gemv_silu_mul

    check_gemv_silu_mul("cpu", torch.float32, 1, inter, k, rms)


@pytest.mark.parametrize("heads, kv_heads, head_dim, k, rms, qk_norm", [
    (4, 2, 16, 64, True, False), (3, 1, 32, 100, False, False), (4, 2, 16, 512, True, True),
    (3, 1, 32, 256, False, True)])
def test_gemv_rotary_store_matches_reference(heads, kv_heads, head_dim, k, rms, qk_norm):
    # qk_norm: gemv_head_norm_store (a head's rows a program must divide head_dim: k >= 256)
    from kernel_cases import check_gemv_rotary_store

    check_gemv_rotary_store("cpu", torch.float32, heads, kv_heads, head_dim, k, rms, qk_norm=qk_norm)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 32), (4, 4, 16)])
def test_varlen_attention_matches_reference(heads, kv_heads, head_dim):
    from kernel_cases import check_varlen

    # a fresh prompt, a chunk after a cached prefix, decode rows, a chunk across block edges
    check_varlen("cpu", torch.float32, heads, kv_heads, head_dim, [(0, 37), (32, 5), (9, 1), (0, 1), (15, 18)])


def test_varlen_attention_sliding_window():
    from kernel_cases import check_varlen

    check_varlen("cpu", torch.float32, 8, 2, 32, [(0, 40), (50, 3)], window=24)


@pytest.mark.parametrize("rows", [1, 5])
def test_embed_rotary_matches_reference(rows):
    from kernel_cases import check_embed_rotary

    check_embed_rotary("cpu", torch.float32, rows, 96, 16)


@pytest.mark.parametrize("rows, vocab", [(1, 5000), (3, 10000)])  # NOTE: a whole -inf block
def test_token_logprob_matches_reference(rows, vocab):
    from kernel_cases import check_token_logprob

    check_token_logprob("cpu", rows, vocab)


@pytest.mark.parametrize("rows, vocab", [(1, 5000), (3, 4097)])
def test_argmax_matches_torch(rows, vocab):
    from kernel_cases import check_argmax

    check_argmax("cpu", rows, vocab)


@pytest.mark.parametrize("rows, vocab, k", [(1, 5000, 5), (3, 4097, 4), (3, 3000, 1)])
def test_topk_logprobs_matches_torch(rows, vocab, k):
    from kernel_cases import check_topk_logprobs

    check_topk_logprobs("cpu", rows, vocab, k)


@pytest.mark.parametrize("tokens, experts, k, hidden, inter", [(1, 8, 2, 64, 48), (3, 8, 3, 40, 70),
                                                               (40, 4, 2, 96, 64)])
def test_moe_grouped_gemm_matches_reference(tokens, experts, k, hidden, inter):
    from kernel_cases import check_moe

    check_moe("cpu", torch.float32, tokens, experts, k, hidden, inter)


def test_moe_grouped_gemm_launch_configs():
    # launches other than gemm_config's (narrow, shallow, fewer stages): results alike
    from hsserve.kernels.moe import GemmConfig
    from kernel_cases import check_moe

    for cfg in (GemmConfig(16, 128, 4, 4), GemmConfig(32, 64, 2, 2), GemmConfig(64, 64, 4, 3)):
        check_moe("cpu", torch.float32, 3, 8, 2, 200, 70, configs=(cfg, cfg))


@pytest.mark.parametrize("tokens, experts, hidden, block_e", [(1, 16, 64, None), (5, 7, 40, 4)])
def test_moe_router_logits_matches_float64(tokens, experts, hidden, block_e):
    from kernel_cases import check_router_logits

    check_router_logits("cpu", torch.float32, tokens, experts, hidden, block_e=block_e)


@pytest.mark.parametrize("tokens, experts, k, renormalize", [(1, 128, 8, True), (3, 8, 2, False),
                                                             (16, 128, 8, True), (5, 6, 3, True),
                                                             (1, 8, 2, True), (2, 5, 5, False),
                                                             (1, 5, 5, False), (1, 6, 3, False),
                                                             (64, 128, 8, False), (37, 60, 4, True),
                                                             (256, 8, 2, True)])
def test_moe_route_align_matches_reference(tokens, experts, k, renormalize):
    from kernel_cases import check_route_align

    check_route_align("cpu", tokens, experts, k, renormalize)


@pytest.mark.parametrize("tokens, experts, k, renormalize", [(1, 16, 4, True), (3, 8, 2, True),
                                                             (64, 128, 8, True)])
def test_moe_decode_route_matches_router_then_route_align(tokens, experts, k, renormalize):
    from kernel_cases import check_decode_route

    check_decode_route("cpu", torch.float32, tokens, experts, 40, k, renormalize)


@pytest.mark.parametrize("experts, k, renormalize", [(16, 4, True), (6, 3, False)])
def test_moe_one_token_experts_route_in_gate_up(experts, k, renormalize):
    from kernel_cases import check_one_token_experts

    check_one_token_experts("cpu", torch.float32, experts, 40, 24, k, renormalize)


@pytest.mark.parametrize("window", [None, 24])
def test_attention_kernels_soft_cap(window):
    # Gemma 2: scores capped (softcap * tanh(s / softcap)) before the mask, decode and varlen
    from kernel_cases import check_varlen

    check_decode("cpu", torch.float32, 8, 2, 32, [1, 17, 50], window=window, num_splits=2,
                 softcap=5.0)
    check_varlen("cpu", torch.float32, 8, 2, 32, [(0, 19), (16, 5)], window=window, softcap=5.0)




def test_guided_bitmask_kernel_matches_reference():
    check_bitmask("cpu")
