"""A full queue refuses the excess; a dead engine loop fails pending and new requests (Issue 7).

Issue 7: a bounded queue refuses the excess with EngineUnavailable; a dead engine loop ends
every pending request with an error and refuses new ones."""

from __future__ import annotations

import threading
import time

import pytest

from hsserve import (
    Engine,
    EngineConfig,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    SamplingParams,
)


def test_overload_refuses_the_excess_quickly_and_serves_the_rest(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu", max_num_seqs=2,
                                 max_queue_size=3)).start()
    try:
        sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        accepted, refused = [], []
        for i in range(4 * 5):  # 4x what the engine holds (2 running + 3 queued)
            t0 = time.perf_counter()
            try:
                accepted.append(engine.submit(GenerationRequest(f"o{i}", prompt_ids=[5, 6, i + 7],
                                                                sampling=sp)))
            except EngineUnavailable as e:
                assert time.perf_counter() - t0 < 0.1
                assert "queue is full" in str(e) and "max_queue_size 3" in str(e)
                refused.append(i)
        assert len(accepted) == 5 and len(refused) == 15
        results = [s.result(timeout=120) for s in accepted]
        assert all(r.finish_reason == FinishReason.LENGTH and len(r.token_ids) == 20 for r in results)
        # room again once they are done
        ok = engine.generate(GenerationRequest("after", prompt_ids=[5], sampling=sp), timeout=60)
        assert len(ok.token_ids) == 20
    finally:
        engine.shutdown()


def test_dead_engine_loop_fails_pending_requests_and_refuses_new_ones(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu")).start()
    sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(GenerationRequest(f"p{i}", prompt_ids=[5, 6, 7], sampling=sp))
               for i in range(3)]
    time.sleep(0.2)
    assert engine.healthy

    def broken():  # NOTE: kills the loop thread itself (not a step error it survives)
        raise SystemExit("simulated crash of the engine thread")

    engine._step = broken
    t0 = time.perf_counter()
    results = [s.result(timeout=10) for s in streams]
    assert time.perf_counter() - t0 < 5
    for r in results:
        assert r.finish_reason == FinishReason.ERROR and "engine stopped" in r.error
    deadline = time.time() + 5
    while engine.healthy and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.healthy
    with pytest.raises(EngineUnavailable, match="not serving"):
        engine.submit(GenerationRequest("late", prompt_ids=[5], sampling=sp))
    engine._thread.join(5)
    assert not any(t.name == engine.thread_name for t in threading.enumerate())
    engine.shutdown()
