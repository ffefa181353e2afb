"""The engine on its Triton attention kernels equals it on the torch reference (interpreter).

The engine on its Triton attention kernels (split-K decode for decode-only steps, one varlen
kernel for every other step) against the same engine on the torch reference, on the CPU through
Triton's interpreter: chunked prefill, prefix-cache hits, mixed prefill/decode steps, every MODE,
a sliding window (Mistral) and q/k norm (Qwen3). The GPU run is tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

import os

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter run is for CPU-only machines",
)

PREFIX = [(37 * i) % 40000 + 50 for i in range(40)]
PROMPTS = [PREFIX + [900 + i] * (3 + 7 * i) for i in range(3)] + [PREFIX[:32], list(range(2000, 2029))]


def run(engine: Engine, mode: HiddenStatesMode, tag: str):
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(GenerationRequest(f"{tag}{i}", prompt_ids=p, sampling=sp,
                                               hidden_mode=mode,
                                               hidden_layers=(1, -1) if mode else None))
               for i, p in enumerate(PROMPTS)]
    return [s.results(timeout=600)[0] for s in streams]


@pytest.mark.parametrize("family, modes", [
    ("llama", list(HiddenStatesMode)),
    ("mistral", [HiddenStatesMode.LAST]),
    ("qwen3", [HiddenStatesMode.FULL]),
])
def test_engine_on_kernels_equals_reference(tiny_model_dir, family, modes, monkeypatch):
    from hsserve.kernels import paged_decode_attention as decode_mod
    from hsserve.kernels import paged_prefill_attention as varlen_mod

    calls = {"varlen": 0, "decode": 0}

    def counted(name, fn):
        def run(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return run

    monkeypatch.setattr(varlen_mod, "paged_varlen_attention",
                        counted("varlen", varlen_mod.paged_varlen_attention))
    monkeypatch.setattr(decode_mod, "paged_decode_attention",
                        counted("decode", decode_mod.paged_decode_attention))
    folder = tiny_model_dir(family)
    ref = Engine(EngineConfig(model=folder, device="cpu", block_size=16,
                              enable_prefix_caching=False)).start()
    ours = Engine(EngineConfig(model=folder, device="cpu", block_size=16, max_num_seqs=4,
                               max_num_batched_tokens=24)).start()
    ours.executor.plan.kernels = True  # NOTE: what CUDA selects; the interpreter runs the kernels here
    try:
        for mode in modes:
            want = run(ref, mode, f"ref-{mode.label}")
            hits = ours.pool.num_hit_tokens
            for tag in ("cold", "warm"):  # NOTE: the second round starts from cached prefixes
                got = run(ours, mode, f"{tag}-{mode.label}")
                for g, w in zip(got, want, strict=True):
                    assert g.token_ids == w.token_ids, (family, mode, tag, g.request_id)
                    if w.hidden is None:
                        assert g.hidden is None
                    else:
                        assert torch.allclose(g.hidden, w.hidden, rtol=0, atol=1e-4)
            if mode != HiddenStatesMode.FULL:
                assert ours.pool.num_hit_tokens > hits
        assert ours.num_mixed_steps > 0  # NOTE: prefill chunks ran beside decode rows
        assert calls["varlen"] > 0 and calls["decode"] > 0  # NOTE: both kernels ran
    finally:
        ref.shutdown()
        ours.shutdown()
