"""Request lifecycle: aborts free every block, refusals name the input, stop conditions hold.

Acceptance 5-6 and request semantics: aborts free every block, threads end, refusals name the input,
stop conditions, prompt-only requests, text decoding."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from hsserve import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    HiddenStatesMode,
    RequestError,
    SamplingParams,
)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_200_mixed_requests_with_aborts_free_every_block(tiny_model_dir, async_scheduling):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", block_size=4,
                                 num_kv_blocks=96, max_num_seqs=16,
                                 async_scheduling=async_scheduling)).start()
    rng = random.Random(7)
    streams, aborted = [], set()
    for i in range(200):
        rid = f"r{i}"
        mode = rng.choice(list(HiddenStatesMode))
        sp = SamplingParams(max_tokens=rng.randint(0, 24), temperature=rng.choice([0.0, 0.8]),
                            seed=i, ignore_eos=rng.random() < 0.5)
        ids = [rng.randint(3, 40000) for _ in range(rng.randint(1, 40))]
        streams.append(engine.submit(GenerationRequest(rid, prompt_ids=ids, sampling=sp,
                                                       hidden_mode=mode,
                                                       hidden_layers=(-1, 1) if mode else None)))
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.01)
            engine.abort(rid)
            aborted.add(rid)
    results = [s.result(timeout=300) for s in streams]
    for r in results:
        assert r.finish_reason is not None
        if r.request_id not in aborted:
            assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), r
    assert sum(r.finish_reason == FinishReason.CANCELLED for r in results) > 10
    deadline = time.time() + 5
    while (engine.num_running or engine.num_waiting) and time.time() < deadline:
        time.sleep(0.01)
    assert engine.num_running == 0 and engine.num_waiting == 0
    # every block not indexed by the prefix cache is free; indexed ones are free too (revivable)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.pool.num_cached > 0
    engine.pool.check_invariants()
    assert engine.scheduler.num_preemptions > 0, "the small pool should have forced preemption"
    engine.clear_prefix_cache()
    deadline = time.time() + 5
    while engine.pool.num_cached and time.time() < deadline:
        time.sleep(0.01)
    assert engine.pool.num_cached == 0 and engine.pool.num_free == engine.pool.num_blocks
    engine.pool.check_invariants()
    assert len(engine.rows) == 0, "no hidden-row ledger left behind"
    engine.shutdown()
    assert not any(t.name == engine.thread_name for t in threading.enumerate())


def test_200_requests_on_a_tiny_pool_equal_unconstrained(tiny_model_dir):
    """Issue 5 acceptance 3: preemption (recompute) under a pool far smaller than the demand,
    with shared prefixes, chunked prompts and n = 2, changes no token and no row."""
    folder = tiny_model_dir("qwen3")
    rng = random.Random(3)
    prefix = [rng.randint(10, 40000) for _ in range(12)]
    reqs = []
    for i in range(200):
        body = [rng.randint(10, 40000) for _ in range(rng.randint(1, 30))]
        mode = [HiddenStatesMode.FULL, HiddenStatesMode.LAST, HiddenStatesMode.NONE][i % 3]
        sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.7, seed=i,
                            ignore_eos=True, n=2 if i % 10 == 0 else 1)
        reqs.append((prefix + body if i % 2 else body, sp, mode))

    def run(blocks, budget):
        engine = Engine(EngineConfig(model=folder, device="cpu", block_size=4, num_kv_blocks=blocks,
                                     max_num_batched_tokens=budget, max_model_len=128)).start()
        try:
            streams = [engine.submit(GenerationRequest(f"p{i}", prompt_ids=p, sampling=sp,
                                                       hidden_mode=mode,
                                                       hidden_layers=(-1,) if mode else None))
                       for i, (p, sp, mode) in enumerate(reqs)]
            results = [s.results(timeout=600) for s in streams]
            assert engine.pool.num_used == 0
            engine.pool.check_invariants()
            return results, engine.scheduler.num_preemptions
        finally:
            engine.shutdown()

    small, preemptions = run(24, 64)  # 96 token slots for 200 requests of up to 66 tokens
    big, _ = run(0, 4096)
    assert preemptions > 0
    for (prompt, sp, mode), a, b in zip(reqs, small, big):
        assert len(a) == len(b) == sp.n
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids and len(x.token_ids) == sp.max_tokens
            if mode == HiddenStatesMode.FULL:
                assert x.hidden.shape == (len(prompt) + sp.max_tokens, 64)
            if mode != HiddenStatesMode.NONE:
                assert torch.allclose(x.hidden, y.hidden, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def strict_engine(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", max_model_len=64,
                                 max_tokens_limit=32, hidden_states_ceiling=HiddenStatesMode.LAST,
                                 hidden_layers_captured=(0, -1))).start()
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "kwargs, name, words",
    [
        (dict(prompt_ids=[5], hidden_mode="middle"), "MODE", "allowed"),
        (dict(prompt_ids=[5], hidden_mode=HiddenStatesMode.FULL), "MODE", "ceiling"),
        (dict(prompt_ids=[5], hidden_mode=HiddenStatesMode.LAST, hidden_layers=(2,)), "hidden_layers",
         "not captured"),
        (dict(prompt_ids=[5], hidden_mode=HiddenStatesMode.LAST, hidden_layers=(9,)), "hidden_layers",
         "outside"),
        (dict(prompt_ids=[5], hidden_layers=(999,)), "hidden_layers", "outside"),
        (dict(prompt_ids=[5], hidden_layers=(2,)), "hidden_layers", "not captured"),
        (dict(prompt_ids=[5], hidden_layers=(-1,)), "hidden_layers", "MODE is none"),
        (dict(prompt_ids=[5], hidden_mode=HiddenStatesMode.LAST, hidden_layers=()), "hidden_layers",
         "empty"),
        (dict(prompt_ids=[5], sampling=SamplingParams(max_tokens=33)), "max_tokens", "0..32"),
        (dict(prompt_ids=[5] * 65), "input_ids", "max_prompt_tokens"),
        (dict(prompt_ids=[5] * 64, sampling=SamplingParams(max_tokens=1)), "input_ids", "max_model_len"),
        (dict(prompt_ids=[]), "input_ids", "empty"),
        (dict(prompt=""), "text_input", "empty"),
        (dict(), "text_input", "exactly one"),
        (dict(prompt="a", prompt_ids=[5]), "text_input", "exactly one"),
        (dict(prompt_ids=[49152]), "input_ids", "vocabulary"),
        (dict(prompt_ids=[5], sampling=SamplingParams(top_p=0.0)), "top_p", "(0, 1]"),
        (dict(prompt_ids=[5], sampling=SamplingParams(temperature=-1.0)), "temperature", ">= 0"),
    ],
)
def test_refused_at_submit_naming_the_input(strict_engine, kwargs, name, words):
    kwargs = dict(kwargs)
    mode = kwargs.pop("hidden_mode", HiddenStatesMode.NONE)
    with pytest.raises(RequestError) as err:
        strict_engine.submit(GenerationRequest("bad", hidden_mode=mode, **kwargs))
    assert err.value.input_name == name
    assert name in str(err.value) and words in str(err.value)
    # the engine keeps serving
    ok = strict_engine.generate(GenerationRequest("ok", prompt_ids=[5, 6], sampling=SamplingParams(
        max_tokens=2, temperature=0)), timeout=60)
    assert ok.finish_reason is not None and len(ok.token_ids) <= 2


def test_prompt_only_returns_prompt_rows(smollm_engine):
    ids = smollm_engine.tokenizer("Hidden states of the prompt only").input_ids
    for mode, rows in [(HiddenStatesMode.FULL, len(ids)), (HiddenStatesMode.LAST, 1),
                       (HiddenStatesMode.NONE, 0)]:
        r = smollm_engine.generate(GenerationRequest(f"p0-{mode.label}", prompt_ids=ids,
                                                     sampling=SamplingParams(max_tokens=0),
                                                     hidden_mode=mode,
                                                     hidden_layers=(-1, 0) if mode else None),
                                   timeout=60)
        assert r.token_ids == [] and r.finish_reason == FinishReason.LENGTH
        assert r.num_input_tokens == len(ids)
        assert (r.hidden is None) if rows == 0 else r.hidden.shape == (rows, 2 * 576)


def test_stop_conditions(smollm_engine):
    base = smollm_engine.generate(GenerationRequest(
        "stop-base", prompt="Count: 1, 2, 3,", sampling=SamplingParams(max_tokens=24, temperature=0,
                                                                        ignore_eos=True)), timeout=60)
    assert base.finish_reason == FinishReason.LENGTH and len(base.token_ids) == 24
    # stop token id: ends at its first occurrence, the token included
    target = base.token_ids[5]
    r = smollm_engine.generate(GenerationRequest(
        "stop-id", prompt="Count: 1, 2, 3,", sampling=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(target,))), timeout=60)
    first = base.token_ids.index(target)
    assert r.token_ids == base.token_ids[: first + 1] and r.finish_reason == FinishReason.STOP
    # stop string: text cut before it, never emitted partially while streaming
    stop = base.text[10:14]
    stream = smollm_engine.submit(GenerationRequest(
        "stop-str", prompt="Count: 1, 2, 3,", sampling=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,))))
    deltas = list(stream)
    text = "".join(d.text for d in deltas)
    assert text == base.text[: base.text.index(stop)]
    assert deltas[-1].finish_reason == FinishReason.STOP


def test_eos_ends_generation_and_ignore_eos_continues(smollm_engine):
    prompt = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
    r = smollm_engine.generate(GenerationRequest("eos", prompt=prompt, sampling=SamplingParams(
        max_tokens=64, temperature=0)), timeout=60)
    assert r.finish_reason == FinishReason.STOP and r.token_ids[-1] == 2
    assert "<|im_end|>" not in r.text
    r2 = smollm_engine.generate(GenerationRequest("eos2", prompt=prompt, sampling=SamplingParams(
        max_tokens=len(r.token_ids) + 3, temperature=0, ignore_eos=True)), timeout=60)
    assert r2.token_ids[: len(r.token_ids)] == r.token_ids
    assert r2.finish_reason == FinishReason.LENGTH


def test_streaming_text_never_splits_utf8(smollm_engine):
    prompt = "Écris en français avec des accents et des emojis 🎉🚀: café, naïve, 日本語"
    stream = smollm_engine.submit(GenerationRequest("utf8", prompt=prompt, sampling=SamplingParams(
        max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)))
    deltas = list(stream)
    # NOTE: only the final flush may end in an incomplete character (generation stopped inside it)
    assert all("\ufffd" not in d.text for d in deltas[:-1])
    ids = [t for d in deltas for t in d.token_ids]
    assert "".join(d.text for d in deltas) == smollm_engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_full_mode_streaming_rows_follow_tokens(smollm_engine):
    ids = smollm_engine.tokenizer("Streaming rows").input_ids
    stream = smollm_engine.submit(GenerationRequest("fs", prompt_ids=ids, sampling=SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True), hidden_mode=HiddenStatesMode.FULL))
    deltas = list(stream)
    assert deltas[0].hidden.shape[0] == len(ids) + len(deltas[0].token_ids)
    for d in deltas[1:]:
        assert d.hidden.shape[0] == len(d.token_ids)
    assert sum(len(d.token_ids) for d in deltas) == 6


def test_abort_unknown_and_finished_is_harmless(smollm_engine):
    smollm_engine.abort("never-submitted")
    r = smollm_engine.generate(GenerationRequest("after-abort", prompt="x", sampling=SamplingParams(
        max_tokens=3, temperature=0)), timeout=60)
    assert r.finish_reason is not None


@pytest.mark.parametrize("wait_ms", [0.0, 400.0])
def test_prefill_wait_gathers_prompts_arriving_while_others_decode(tiny_model_dir, wait_ms):
    """prefill_wait_ms: prompts arriving 10 ms apart while a request decodes prefill in one step
    (and none before the wait); with 0 each is admitted at once, in a step of its own."""
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", max_num_seqs=8,
                                 prefill_wait_ms=wait_ms)).start()
    try:
        endless = engine.submit(GenerationRequest("long", prompt_ids=[5, 6, 7], sampling=SamplingParams(
            max_tokens=500, ignore_eos=True, temperature=0.0)))
        next(iter(endless))
        mixed, steps = engine.num_mixed_steps, engine.num_steps
        t0 = time.monotonic()
        streams = []
        for i in range(3):
            streams.append(engine.submit(GenerationRequest(f"p{i}", prompt_ids=[9 + i] * 5,
                                                           sampling=SamplingParams(max_tokens=2))))
            time.sleep(0.01)
        first = [next(iter(s)) for s in streams]
        waited = time.monotonic() - t0
        assert all(d.token_ids for d in first)
        if wait_ms:
            assert engine.num_mixed_steps == mixed + 1
            assert waited >= wait_ms / 1000 - 0.01
        else:
            assert engine.num_mixed_steps >= mixed + 2, (engine.num_mixed_steps, mixed,
                                                         engine.num_steps - steps)
        engine.abort("long")
        assert endless.result(timeout=60).finish_reason == FinishReason.CANCELLED
    finally:
        engine.shutdown()


def test_mode_none_needs_no_captured_layer(tiny_model_dir):
    """A server capturing only some layers (not the last) serves MODE none requests; the default
    layer [-1] is asked only with rows, and refused there by name."""
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                 hidden_layers_captured=(1,))).start()
    try:
        res = engine.generate(GenerationRequest("none", prompt_ids=[5, 6], sampling=SamplingParams(
            max_tokens=2, temperature=0.0)), timeout=60)
        assert len(res.token_ids) == 2 and res.hidden is None
        with pytest.raises(RequestError, match="not captured"):
            engine.submit(GenerationRequest("last", prompt_ids=[5], hidden_mode="last"))
    finally:
        engine.shutdown()
