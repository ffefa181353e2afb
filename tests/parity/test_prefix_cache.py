"""With the prefix cache and chunked prefill, tokens and rows equal a cold run for every MODE.

Issue 5 acceptance 1: with the prefix cache and chunked prefill, tokens and hidden rows equal a
cold run (no cache, whole prompts) for every MODE: shared prefixes, a complete cache hit, a prompt
longer than the chunk, n = 4 seeded samples."""

from __future__ import annotations

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

PREFIX = [(37 * i) % 40000 + 50 for i in range(30)]
PROMPTS = [
    PREFIX + [900 + i] * (2 + 3 * i) for i in range(3)
] + [
    PREFIX[:28],  # a whole number of blocks: a complete hit reuses all but the last block
    PREFIX[:28],  # the same prompt twice in one batch
    PREFIX + list(range(1000, 1045)),  # 75 tokens: longer than the 16-token chunk
]


def run(engine: Engine, mode: HiddenStatesMode, sampling: SamplingParams, tag: str):
    streams = [
        engine.submit(GenerationRequest(f"{tag}{i}", prompt_ids=p, sampling=sampling,
                                        hidden_mode=mode, hidden_layers=(0, -1) if mode else None))
        for i, p in enumerate(PROMPTS)
    ]
    return [s.results(timeout=300) for s in streams]


def assert_same(got, want):
    for g_req, w_req in zip(got, want, strict=True):
        assert len(g_req) == len(w_req)
        for g, w in zip(g_req, w_req):
            assert g.token_ids == w.token_ids, (g.request_id, g.sequence_index)
            assert g.finish_reason == w.finish_reason
            if w.hidden is None:
                assert g.hidden is None
            else:
                assert g.hidden.shape == w.hidden.shape
                assert torch.allclose(g.hidden, w.hidden, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    folder = tiny_model_dir("llama")
    cold = Engine(EngineConfig(model=folder, device="cpu", block_size=4,
                               enable_prefix_caching=False)).start()
    warm = Engine(EngineConfig(model=folder, device="cpu", block_size=4, max_num_seqs=8,
                               max_num_batched_tokens=16)).start()
    yield cold, warm
    cold.shutdown()
    warm.shutdown()


@pytest.mark.parametrize("mode", list(HiddenStatesMode))
@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, seed=11, n=4, ignore_eos=True),
    SamplingParams(max_tokens=0),
], ids=["greedy", "n4-seeded", "prompt-only"])
def test_warm_cache_equals_cold(engines, mode, sampling):
    cold, warm = engines
    want = run(cold, mode, sampling, "cold")
    hits = warm.pool.num_hit_tokens
    first = run(warm, mode, sampling, "warm1")  # fills the cache (and shares within the batch)
    second = run(warm, mode, sampling, "warm2")  # every prompt's prefix is cached now
    assert_same(first, want)
    assert_same(second, want)
    if mode == HiddenStatesMode.FULL or (mode == HiddenStatesMode.NONE and not sampling.max_tokens):
        # full mode recomputes its prompt rows; a prompt-only request without rows computes nothing
        assert warm.pool.num_hit_tokens == hits
    else:
        # the second round finds at least 7 cached blocks (28 tokens) of every prompt
        assert warm.pool.num_hit_tokens - hits >= 28 * len(PROMPTS) * sampling.n
    if sampling.n > 1:
        for req in want:
            assert [r.sequence_index for r in req] == [0, 1, 2, 3]
            assert len({tuple(r.token_ids) for r in req}) > 1, "seeded samples should differ"
    assert warm.pool.num_used == 0 and warm.pool.num_free == warm.pool.num_blocks
    warm.pool.check_invariants()


def test_chunked_prefill_splits_the_long_prompt(engines):
    _, warm = engines
    steps = warm.num_steps
    res = warm.generate(GenerationRequest("long", prompt_ids=list(range(2000, 2075)),
                                          sampling=SamplingParams(max_tokens=1)))
    assert len(res.token_ids) == 1
    assert warm.num_steps - steps >= 5  # 75 prompt tokens through a 16-token budget


def test_smollm2_system_prompt_warm_equals_cold(smollm_dir, smollm_engine):
    system = ("You are a careful assistant. Answer briefly, cite no sources, and never "
              "invent facts. ") * 6
    questions = ["What is the capital of France?", "Name a prime number.", "Say hello."]
    cold = Engine(EngineConfig(model=smollm_dir, device="cpu", enable_prefix_caching=False)).start()
    try:
        for mode in (HiddenStatesMode.LAST, HiddenStatesMode.FULL):
            sp = SamplingParams(max_tokens=8, temperature=0.0)
            for q in questions:
                req = lambda tag: GenerationRequest(f"{tag}-{mode.label}-{q}", prompt=system + q,
                                                    sampling=sp, hidden_mode=mode, hidden_layers=(-1,))
                want = cold.generate(req("cold"))
                smollm_engine.generate(req("fill"))
                got = smollm_engine.generate(req("warm"))
                assert got.token_ids == want.token_ids
                assert torch.allclose(got.hidden, want.hidden, rtol=0, atol=1e-3)
    finally:
        cold.shutdown()
    assert smollm_engine.pool.num_hit_tokens > 0
