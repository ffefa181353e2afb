"""Before min_tokens, EOS and stop ids are masked and no stop string ends the sequence (Issue 25).

Issue 25: min_tokens (vllm_backend's, genai-perf's; TensorRT-LLM's min_length): before it, EOS
and the stop ids are never sampled (masked, as transformers' min_new_tokens does) and no stop
string ends the sequence; greedy tokens equal transformers', alone and batched."""

from __future__ import annotations

import pytest
from oracle import hf_greedy

from hsserve import Engine, EngineConfig, FinishReason, GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu")).start()
    yield engine
    engine.shutdown()


def test_min_tokens_masks_eos_and_stop_ids_as_transformers_does(engine, tiny_model_dir, hf_model):
    hf = hf_model(tiny_model_dir("llama"))
    eos = sorted(engine.spec.eos_token_ids)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]
    streams, expected, firsts = [], [], []
    for i, p in enumerate(prompts):
        first = hf_greedy(hf, p, 1, eos)[0]  # NOTE: made a stop id: without min_tokens, 1 token
        firsts.append(first)
        alone = engine.generate(GenerationRequest(f"plain{i}", prompt_ids=p, sampling=SamplingParams(
            max_tokens=8, temperature=0.0, stop_token_ids=(first,))), timeout=60)
        assert alone.token_ids == [first] and alone.finish_reason == FinishReason.STOP
        sp = SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0, stop_token_ids=(first,))
        streams.append(engine.submit(GenerationRequest(f"min{i}", prompt_ids=p, sampling=sp)))
        expected.append(hf_greedy(hf, p, 8, [*eos, first], min_new_tokens=4))
    for s, want, first in zip(streams, expected, firsts):
        got = s.result(timeout=60)
        assert got.token_ids == want, (got.token_ids, want)
        assert len(got.token_ids) >= 4 and not set(got.token_ids[:4]) & {*eos, first}


def test_no_stop_string_before_min_tokens(smollm_engine):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    req = GenerationRequest("free", prompt="The capital of France is", sampling=sp)
    free = smollm_engine.generate(req, timeout=120)
    word = free.text.split()[0]  # NOTE: its first word, made a stop string
    stop = smollm_engine.generate(GenerationRequest("stop", prompt="The capital of France is",
                                                    sampling=SamplingParams(
                                                        max_tokens=12, temperature=0.0,
                                                        ignore_eos=True, stop=(word,))), timeout=120)
    assert stop.finish_reason == FinishReason.STOP and word not in stop.text
    late = smollm_engine.generate(GenerationRequest("late", prompt="The capital of France is",
                                                    sampling=SamplingParams(
                                                        max_tokens=12, min_tokens=12,
                                                        temperature=0.0, ignore_eos=True,
                                                        stop=(word,))), timeout=120)
    assert late.token_ids == free.token_ids and late.finish_reason == FinishReason.LENGTH
