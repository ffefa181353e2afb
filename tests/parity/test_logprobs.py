"""A generated token's logprob, rank and top-k equal transformers' (Issue 25).

Issue 25: a generated token's log-probability, rank and top-k equal transformers' (the
log-softmax of its logits on the same tokens, before any sampling transform): greedy and
sampled, n > 1, beside hidden rows, with steps queued ahead or not."""

from __future__ import annotations

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module", params=["off", "on"])
def engine(request, tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                 async_scheduling=request.param)).start()
    yield engine
    engine.shutdown()


def hf_logprobs(hf, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: log-softmax of the logits that produced each generated token."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def check(res, prompt, hf, k):
    ref = hf_logprobs(hf, prompt, res.token_ids)
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids)
    for t, (token, e) in enumerate(zip(res.token_ids, res.logprobs)):
        want = ref[t, token].item()
        assert abs(e.logprob - want) <= TOL, (t, e.logprob, want)
        assert e.rank == int((ref[t] > want).sum()) + 1
        top = ref[t].topk(k)
        assert e.top_ids == top.indices.tolist()
        assert max((abs(a - b) for a, b in zip(e.top_logprobs, top.values.tolist())),
                   default=0.0) <= TOL
    total = sum(e.logprob for e in res.logprobs)
    assert abs(res.cumulative_logprob - total) <= 1e-3


def test_logprobs_equal_transformers(engine, tiny_model_dir, hf_model):
    hf = hf_model(tiny_model_dir("llama"))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44, 45]]
    cases = [
        (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3), "none"),
        (SamplingParams(max_tokens=6, temperature=0.9, seed=7, n=2, ignore_eos=True, logprobs=2),
         "last"),
        (SamplingParams(max_tokens=5, temperature=0.0, min_tokens=5, logprobs=0), "full"),
    ]
    streams = []
    for i, p in enumerate(prompts):
        for j, (sp, mode) in enumerate(cases):
            rows = dict(hidden_mode=mode, hidden_layers=(-1,)) if mode != "none" else {}
            streams.append((p, sp, engine.submit(GenerationRequest(f"lp{i}-{j}", prompt_ids=p,
                                                                   sampling=sp, **rows))))
    for p, sp, s in streams:
        for res in s.results(timeout=120):
            check(res, p, hf, sp.logprobs)


def test_no_logprobs_unless_asked(engine):
    res = engine.generate(GenerationRequest("plain", prompt_ids=[5, 6], sampling=SamplingParams(
        max_tokens=3, temperature=0.0), hidden_mode=HiddenStatesMode.NONE), timeout=60)
    assert res.logprobs is None and res.cumulative_logprob is None
