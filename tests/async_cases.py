"""Provides the async-vs-sync check that the CPU and GPU runs share (check_async_equals_sync).

Async scheduling vs sync on the same requests, shared by the CPU run and the GPU run: an engine
with it on and one with it off must give the same tokens, text, rows and finish reasons, and
every block must come back."""

from __future__ import annotations

import random
import time

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from oracle import max_rel_row_diff

MODES = [HiddenStatesMode.FULL, HiddenStatesMode.LAST, HiddenStatesMode.NONE]
LAYERS = [(-1,), (0, 2, -1), (1,)]


def config(folder: str, mode: str, device: str, block_size: int = 4, **kw) -> EngineConfig:
    # NOTE: 6 sequences at once for 18 requests: prompts arrive while others decode; a pool of
    # 120-128 tokens for up to 6 x 70: it runs dry and preempts
    return EngineConfig(model=folder, device=device, block_size=block_size, max_num_seqs=6,
                        num_kv_blocks=-(-120 // block_size), async_scheduling=mode, **kw)


def requests(plain: list | None, vocab: int) -> list[GenerationRequest]:
    """18 requests of every kind; given the outputs of a plain run (`plain`), some stop on one
    of their own tokens or (with a tokenizer) on a piece of their own text."""
    rng = random.Random(11)
    reqs = []
    for i in range(18):
        kind = i % 4
        sp = dict(max_tokens=[0, 1, 6, 40, 22, 31, 40][i % 7], ignore_eos=i % 5 == 0,
                  temperature=0.0 if kind == 0 else [0.8, 1.0, 0.7][kind - 1], seed=100 + i,
                  top_k=5 if kind == 2 else 0, top_p=0.9 if kind == 3 else 1.0, n=2 if i == 9 else 1)
        if plain is not None:
            out = plain[i][0]
            half = len(out.token_ids) // 2
            if i % 3 == 1 and len(out.text) > 12:
                sp["stop"] = (out.text[len(out.text) // 2 :][:3],)
            elif i % 3 != 2 and half > 1:
                sp["stop_token_ids"] = (out.token_ids[half],)
        prompt = [rng.randint(3, vocab - 1) for _ in range(rng.randint(1, 30))]
        reqs.append(GenerationRequest(f"r{i}", prompt_ids=prompt, sampling=SamplingParams(**sp),
                                      hidden_mode=MODES[i % 3],
                                      hidden_layers=LAYERS[i % 3] if MODES[i % 3] else None))
    return reqs


def run(cfg: EngineConfig, reqs: list[GenerationRequest]):
    """Results, steps queued ahead, preemptions; checks that every block came back."""
    engine = Engine(cfg).start()
    try:
        streams = [engine.submit(r) for r in reqs[:8]]
        time.sleep(0.05)  # NOTE: the rest arrive while the first ones decode
        streams += [engine.submit(r) for r in reqs[8:]]
        results = [s.results(timeout=300) for s in streams]
        deadline = time.time() + 5
        while (engine.num_running or engine.num_waiting) and time.time() < deadline:
            time.sleep(0.01)
        assert engine.pool.num_free == engine.pool.num_blocks
        engine.pool.check_invariants()
        return results, engine.num_ahead_steps, engine.scheduler.num_preemptions
    finally:
        engine.shutdown()


def assert_same(a, b, tol: float, reqs: list[GenerationRequest]) -> None:
    """Tokens, text, finish reasons equal; rows within tol x the row's norm (per layer)."""
    assert len(a) == len(b)
    layers_of = {r.request_id: len(r.hidden_layers or (-1,)) for r in reqs}
    for x, y in zip(a, b):
        num_layers = layers_of[x.request_id]
        key = (x.request_id, x.sequence_index)
        assert x.token_ids == y.token_ids, key
        assert x.text == y.text, key
        assert x.finish_reason == y.finish_reason, key
        assert (x.num_input_tokens, x.num_output_tokens) == (y.num_input_tokens, y.num_output_tokens)
        assert (x.hidden is None) == (y.hidden is None), key
        if x.hidden is not None:
            assert x.hidden.shape == y.hidden.shape, key
            worst = max_rel_row_diff(y.hidden, x.hidden, num_layers)
            bad = ((x.hidden - y.hidden).abs() > tol * x.hidden.norm(dim=-1, keepdim=True)).any(-1)
            assert worst <= tol, (key, worst, bad.nonzero().flatten().tolist(), len(x.hidden),
                                  x.num_input_tokens)


def check_async_equals_sync(folder: str, device: str, vocab: int, tol: float, **kw) -> None:
    plain, _, _ = run(config(folder, "off", device, **kw), requests(None, vocab))
    reqs = requests(plain, vocab)
    assert sum(bool(r.sampling.stop_token_ids or r.sampling.stop) for r in reqs) >= 6
    sync, _, _ = run(config(folder, "off", device, **kw), reqs)
    ahead, num_ahead, preemptions = run(config(folder, "on", device, **kw), reqs)
    assert num_ahead > 20, f"only {num_ahead} steps were queued ahead"
    assert preemptions > 0, "the small pool should have forced preemption"
    stopped = [r for r in sync if r[0].finish_reason.value == "stop"]
    assert len(stopped) >= 4, "too few requests stopped on a token or a string to test"
    for x, y in zip(sync, ahead):
        assert_same(x, y, tol, reqs)
