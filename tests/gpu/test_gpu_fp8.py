"""Proves the float8 kernels and FP8 checkpoints on CUDA (pytest -m gpu): kernels exact, rows close.

The kernels against their float64 oracles at real shapes (fp8_kernel_cases.py), x off the
float8 grid; then tiny Llama, Qwen3 and Qwen3-MoE FP8 checkpoints (compressed-tensors layout)
in bfloat16 through the engine (GEMV at batch 1, the GEMM above it, the CUDA graphs) against
transformers loading the same checkpoint in float32: each row of our own tokens at cosine >=
0.999. Where the checkpoint quantizes activations, the float8 rounding of a bf16 x can differ
from that of transformers' float32 x by one float8 step, so those rows hold 0.995.
"""

from __future__ import annotations

import pytest
import torch

from fp8_checkpoints import write_fp8_copy
from fp8_kernel_cases import (SCHEMES, check_fp8_gemm, check_fp8_gemv,
                              check_fp8_gemv_rotary_store, check_quantize_rows)
from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from oracle import hf_hidden
from tiny_models import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = (0, 1, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_on_cuda(dtype):
    check_quantize_rows("cuda", dtype)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
@pytest.mark.parametrize("m, n, k", [(2, 6144, 4096), (16, 4096, 4096), (64, 28672, 4096),
                                     (300, 1000, 576), (2048, 4096, 4096)])
def test_fp8_gemm_on_cuda(m, n, k, quantize_inputs, static):
    check_fp8_gemm("cuda", torch.bfloat16, m, n, k, quantize_inputs, static)


@pytest.mark.parametrize("cfg", [(128, 64, 64, 1, 4, 3), (256, 16, 128, 4, 8, 3),
                                 (64, 64, 128, 3, 4, 4)])
@pytest.mark.parametrize("m, n, k", [(16, 4096, 4096), (64, 4096, 14336), (40, 1000, 576)])
def test_fp8_swapped_gemm_on_cuda(m, n, k, cfg, monkeypatch):
    import hsserve.kernels.fp8 as fp8

    monkeypatch.setattr(fp8, "swap_config", lambda *_a: cfg)
    check_fp8_gemm("cuda", torch.bfloat16, m, n, k, False, False)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(4096, 4096), (28672, 8192), (8192, 14336), (1000, 576)])
def test_fp8_gemv_on_cuda(n, k, dtype, quantize_inputs, static):
    check_fp8_gemv("cuda", dtype, n, k, quantize_inputs, static)


@pytest.mark.parametrize("quantize_inputs, static", SCHEMES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, k, qk_norm", [
    (32, 8, 128, 4096, False), (64, 8, 128, 8192, False), (32, 4, 128, 2048, True),
    (9, 3, 64, 576, False)])
def test_fp8_gemv_rotary_store_on_cuda(heads, kv_heads, head_dim, k, qk_norm, quantize_inputs,
                                       static):
    check_fp8_gemv_rotary_store("cuda", torch.bfloat16, heads, kv_heads, head_dim, k,
                                quantize_inputs, static, qk_norm)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """(family, weights, activations) -> (FP8 folder, transformers float32 on it, the bf16
    source folder)."""
    from transformers import AutoModelForCausalLM

    def make(family, weights, activations):
        cfg = tiny_config(family)
        cfg.initializer_range = 0.02  # NOTE: as test_gpu_families' bf16 runs: no peaked attention
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # NOTE: routers 20x: no expert choice a rounding can flip
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.mul_(20.0)
        src = str(tmp_path_factory.mktemp(f"src-{family}"))
        model.save_pretrained(src)
        dst = write_fp8_copy(src, str(tmp_path_factory.mktemp(f"fp8-{family}")), weights,
                             activations)
        hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        return dst, hf, src

    return make


def _generate(folder, prompts, batch, quantization="none"):
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype="bfloat16",
                                 quantization=quantization, max_num_seqs=batch,
                                 max_model_len=256)).start()
    try:
        assert engine.num_graph_captures > 0
        streams = [engine.submit(GenerationRequest(
            f"q{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=10, temperature=0.0),
            hidden_mode=HiddenStatesMode.FULL, hidden_layers=LAYERS)) for i, p in enumerate(prompts)]
        results = [s.result(timeout=300) for s in streams]
        assert engine.pool.num_free == engine.pool.num_blocks
        return results
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family, weights, activations", [
    ("llama", "channel", None), ("llama", "tensor", "tensor"), ("llama", "channel", "token"),
    ("qwen3", "channel", None), ("qwen3_moe", "channel", "token")])
def test_an_fp8_checkpoint_in_bf16_matches_transformers(fp8_model, family, weights, activations):
    folder, hf, _ = fp8_model(family, weights, activations)
    _assert_close(hf, folder, 0.999 if activations is None else 0.995)


def test_quantization_fp8_at_load_on_cuda(fp8_model):
    # NOTE: the bf16 source quantized at load against transformers on the float8 checkpoint
    _, hf, src = fp8_model("llama", "channel", None)
    _assert_close(hf, src, 0.999, quantization="fp8")


def _assert_close(hf, folder, floor, quantization="none"):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (1, 9, 30, 70)]
    for batch in (1, 4):  # NOTE: one row a step (the GEMVs), then four (the GEMM)
        for p, r in zip(prompts, _generate(folder, prompts[:1] if batch == 1 else prompts, batch,
                                           quantization)):
            ref = hf_hidden(hf, p + r.token_ids, LAYERS)[: len(r.hidden)]
            for ours, theirs in zip(r.hidden.float().chunk(3, -1), ref.chunk(3, -1)):
                cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
                assert float(cos.min()) >= floor, (batch, float(cos.min()))
