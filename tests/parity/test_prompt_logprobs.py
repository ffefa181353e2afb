"""Prompt logprobs (issue 45 item 2): each prompt token's log-probability equals transformers'.

`prompt_logprobs` k: per prompt token (the first None) its log-probability, rank and k most
likely alternatives, equal to transformers' log_softmax within 1e-4 on the CPU; answered once, in
completion 0's first delta with tokens; with max_tokens 0, chunked prefill, preemption, n > 1 and
speculative drafts; a request asking for them bypasses the prefix cache (every prompt position's
logits are computed), and a cached prefix still gets its logprobs."""

from __future__ import annotations

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams
from hsserve.request import RequestError

TOL = 1e-4


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: the log-softmax that scored prompt tokens 1.."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(entries, prompt, ref, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for t, e in enumerate(entries[1:]):
        want = ref[t, prompt[t + 1]].item()
        assert abs(e.logprob - want) <= TOL, (t, e.logprob, want)
        # NOTE: a rank among near-equal values: counted within the tolerance
        assert int((ref[t] > want + TOL).sum()) < e.rank <= int((ref[t] > want - TOL).sum()) + 1
        top = ref[t].topk(k).values
        assert len(e.top_ids) == len(e.top_logprobs) == k
        # NOTE: the k most likely, up to ties within the tolerance
        assert torch.allclose(ref[t][e.top_ids], top, atol=TOL)
        assert torch.allclose(torch.tensor(e.top_logprobs), top, atol=TOL)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, hf_model):
    folder = tiny_model_dir("llama")
    # NOTE: a small token budget chunks the prompts; a small pool preempts
    engine = Engine(EngineConfig(model=folder, device="cpu", max_num_seqs=4,
                                 max_num_batched_tokens=24, num_kv_blocks=12, block_size=8)).start()
    yield engine, hf_model(folder)
    engine.shutdown()


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (length,), generator=g).tolist() for _ in range(n)]


def test_chunked_preempted_prompts_get_transformers_logprobs_once(tiny):
    engine, hf = tiny
    preempted = engine.scheduler.num_preemptions
    reqs = [GenerationRequest(f"p{i}", prompt_ids=p, sampling=SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=(0, 3)[i % 2]))
        for i, p in enumerate(prompts(4, 30, 1))]
    streams = [engine.submit(r) for r in reqs]
    for req, stream in zip(reqs, streams):
        deltas = list(stream)
        carrying = [d for d in deltas if d.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0] is next(d for d in deltas if d.token_ids)
        check(carrying[0].prompt_logprobs, req.prompt_ids, hf_prompt_logprobs(hf, req.prompt_ids),
              req.sampling.prompt_logprobs)
    assert engine.scheduler.num_preemptions > preempted, "the small pool preempts mid-prompt"


def test_prompt_only_request_is_computed_for_its_logprobs(tiny):
    engine, hf = tiny
    prompt = prompts(1, 40, 2)[0]
    res = engine.generate(GenerationRequest("zero", prompt_ids=prompt, sampling=SamplingParams(
        max_tokens=0, prompt_logprobs=2)), timeout=120)
    assert res.token_ids == [] and res.num_input_tokens == 40
    check(res.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 2)
    plain = engine.generate(GenerationRequest("zero2", prompt_ids=prompt,
                                              sampling=SamplingParams(max_tokens=0)), timeout=60)
    assert plain.prompt_logprobs is None


def test_n_completions_carry_them_once(tiny):
    engine, hf = tiny
    prompt = prompts(1, 12, 3)[0]
    results = engine.submit(GenerationRequest("n2", prompt_ids=prompt, sampling=SamplingParams(
        max_tokens=4, n=2, temperature=1.0, seed=1, prompt_logprobs=1))).results(timeout=120)
    assert results[0].prompt_logprobs is not None and results[1].prompt_logprobs is None
    check(results[0].prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 1)


def test_the_prefix_cache_is_bypassed_and_a_cached_prefix_still_gets_logprobs(smollm_engine,
                                                                          hf_model, smollm_dir):
    text = "A long shared system prompt about the weather in several cities, " * 4
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    smollm_engine.generate(GenerationRequest("warm", prompt=text, sampling=sp), timeout=120)
    hits = smollm_engine.pool.num_hit_tokens
    res = smollm_engine.generate(GenerationRequest("lp", prompt=text, sampling=SamplingParams(
        max_tokens=2, temperature=0.0, prompt_logprobs=0)), timeout=120)
    assert smollm_engine.pool.num_hit_tokens == hits, "not taken from the cache"
    prompt = smollm_engine.tokenizer(text)["input_ids"]
    check(res.prompt_logprobs, prompt, hf_prompt_logprobs(hf_model(smollm_dir), prompt), 0)


def test_out_of_range_prompt_logprobs_are_refused_naming_the_field():
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate(100, 1, 20)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate(100, 1, 20)
