"""Acceptance 4: seeded sampling is reproducible alone or in a busy batch; top_k=1 is greedy."""

from __future__ import annotations

from hsserve import GenerationRequest, SamplingParams

PROMPT = "Tell me a story about a dragon"


def sampled(engine, rid, **kw):
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True, **kw)
    return GenerationRequest(rid, prompt=PROMPT, sampling=sp)


def test_seeded_alone_equals_busy_batch(smollm_engine):
    alone = smollm_engine.generate(sampled(smollm_engine, "s-alone", seed=42), timeout=120)
    noise = [
        smollm_engine.submit(GenerationRequest(
            f"s-noise{i}", prompt=f"Noise request number {i}",
            sampling=SamplingParams(max_tokens=30, temperature=1.0, seed=i)))
        for i in range(10)
    ]
    busy = smollm_engine.submit(sampled(smollm_engine, "s-busy", seed=42))
    other = smollm_engine.submit(sampled(smollm_engine, "s-other", seed=43))
    for n in noise:
        n.result(timeout=300)
    busy, other = busy.result(timeout=300), other.result(timeout=300)
    assert len(alone.token_ids) == 24
    assert busy.token_ids == alone.token_ids
    assert other.token_ids != alone.token_ids, "different seeds gave the same 24 tokens"


def test_top_k_1_equals_greedy(smollm_engine):
    greedy = smollm_engine.generate(GenerationRequest(
        "g", prompt=PROMPT, sampling=SamplingParams(max_tokens=20, temperature=0.0)), timeout=120)
    topk1 = smollm_engine.generate(GenerationRequest(
        "k1", prompt=PROMPT, sampling=SamplingParams(max_tokens=20, temperature=1.3, top_k=1, seed=5)),
        timeout=120)
    assert topk1.token_ids == greedy.token_ids


def test_unseeded_requests_differ(smollm_engine):
    outs = [
        smollm_engine.generate(GenerationRequest(
            f"u{i}", prompt=PROMPT,
            sampling=SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)), timeout=120)
        for i in range(2)
    ]
    assert outs[0].token_ids != outs[1].token_ids
