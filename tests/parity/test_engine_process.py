"""The engine in a child process serves what the in-process one does, refusals and stops included.

The engine in a child process (engine/process.py, what the Triton adapter runs by default) against
the engine in this process: the same outputs for every kind of request, refusals at submit,
aborts, every block back, a killed child ending what was in flight, a clean stop."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from async_cases import assert_same, config, requests
from hsserve import (
    Engine,
    EngineConfig,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    HiddenStatesMode,
    RequestError,
    SamplingParams,
)
from hsserve.engine.config import ConfigError
from hsserve.engine.messages import delta_from_wire, delta_to_wire
from hsserve.engine.process import EngineProcess
from hsserve.request import Delta

ENDLESS = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)


def collect(engine, reqs):
    streams = [engine.submit(r) for r in reqs]
    return [s.results(timeout=300) for s in streams]


@pytest.fixture(scope="module")
def child(tiny_model_dir):
    engine = EngineProcess(config(tiny_model_dir("llama"), "off", "cpu", max_queue_size=12)).start()
    yield engine
    engine.shutdown()


def test_same_outputs_as_in_process(child, tiny_model_dir):
    cfg = config(tiny_model_dir("llama"), "off", "cpu", max_queue_size=12)
    local = Engine(cfg).start()
    try:
        plain = collect(local, requests(None, 49152))
        reqs = requests(plain, 49152)
        want = collect(local, reqs)
    finally:
        local.shutdown()
    got = collect(child, reqs)
    assert sum(len(r[0].token_ids) for r in got) > 100
    assert any(r[0].hidden is not None for r in got) and any(len(r) == 2 for r in got)
    for x, y in zip(want, got):
        assert_same(x, y, 1e-4, reqs)
    snap = child.snapshot()
    assert snap.blocks_used == 0 and snap.running == 0 and snap.waiting == 0
    assert snap.generation_tokens >= sum(len(c.token_ids) for r in got for c in r)
    assert snap.ttft and snap.itl and snap.latency


def test_every_delta_is_followed_by_a_round_end(tiny_model_dir):
    """The engine process ships a round's deltas at after_round: every delta, those of a
    shutdown included, must reach its sink before some after_round call (none left behind)."""
    seen: list[Delta] = []
    shipped: list[int] = []  # NOTE: deltas seen at each after_round call
    engine = Engine(config(tiny_model_dir("llama"), "on", "cpu"),
                    after_round=lambda: shipped.append(len(seen))).start()
    try:
        for i in range(3):
            engine.submit(GenerationRequest(f"r{i}", prompt_ids=[5, 6, 7 + i],
                                            sampling=SamplingParams(max_tokens=4 + i)),
                          sink=seen.append)
        engine.submit(GenerationRequest("long", prompt_ids=[5, 6], sampling=ENDLESS),
                      sink=seen.append)
        deadline = time.monotonic() + 60
        while sum(d.request_done for d in seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert sum(d.request_done for d in seen) == 4  # NOTE: the long one ended by the shutdown
    assert seen[-1].request_id == "long" and seen[-1].finish_reason == FinishReason.ERROR
    assert shipped and shipped[-1] == len(seen)
    assert shipped == sorted(shipped) and len(set(shipped)) > 3  # NOTE: shipped round by round


def test_refusals_name_the_input_at_submit(child):
    cases = [(GenerationRequest("e", prompt=""), "text_input"),
             (GenerationRequest("m", prompt_ids=[5, 6], hidden_mode="most"), "MODE"),
             (GenerationRequest("l", prompt_ids=[5, 6], hidden_mode=HiddenStatesMode.LAST,
                                hidden_layers=(9,)), "hidden_layers"),
             (GenerationRequest("t", prompt_ids=[5], sampling=SamplingParams(max_tokens=10**6)),
              "max_tokens")]
    for req, name in cases:
        with pytest.raises(RequestError, match=name):
            child.submit(req)


def test_queue_limit_duplicate_ids_and_abort(child):
    # max_num_seqs 6 + max_queue_size 12: the 19th request in flight is refused
    streams = [child.submit(GenerationRequest(f"q{i}", prompt_ids=[7, 8, 9], sampling=ENDLESS))
               for i in range(18)]
    with pytest.raises(RequestError, match="request_id"):
        child.submit(GenerationRequest("q0", prompt_ids=[7]))
    with pytest.raises(EngineUnavailable, match="queue is full"):
        child.submit(GenerationRequest("q18", prompt_ids=[7]))
    next(iter(streams[0]))  # generating
    for i in range(18):
        child.abort(f"q{i}")
    for s in streams:
        assert s.result(timeout=60).finish_reason == FinishReason.CANCELLED
    deadline = time.time() + 10
    while time.time() < deadline:
        snap = child.snapshot()
        if snap.blocks_used == 0 and snap.running == 0:
            break
        time.sleep(0.05)
    assert snap.blocks_used == 0 and snap.running == 0 and snap.waiting == 0
    assert child.submit(GenerationRequest("q0", prompt_ids=[7, 8])).result(60).finish_reason in (
        FinishReason.STOP, FinishReason.LENGTH)


def test_rows_and_logprobs_cross_the_pipe():
    import torch

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = torch.randn(3, 10).to(dtype)
        d = Delta("r", [1, 2], "ab", rows, FinishReason.STOP, 4, 2, None, 1, True)
        back = delta_from_wire(delta_to_wire(d))
        assert back.hidden.dtype == dtype and torch.equal(back.hidden, rows)
        assert (back.token_ids, back.text, back.finish_reason, back.num_input_tokens,
                back.num_output_tokens, back.sequence_index, back.request_done) == (
                    [1, 2], "ab", FinishReason.STOP, 4, 2, 1, True)
    assert delta_from_wire(delta_to_wire(Delta("r", [], ""))).hidden is None
    from hsserve.request import TokenLogprob

    entries = [None, TokenLogprob(-1.5, 2, [3], [-0.5])]
    back = delta_from_wire(delta_to_wire(Delta("r", [1], "a", prompt_logprobs=entries,
                                               logprobs=entries[1:], cumulative_logprob=-1.5)))
    assert back.prompt_logprobs == entries and back.logprobs == entries[1:]
    assert back.cumulative_logprob == -1.5


def test_a_killed_child_ends_what_was_in_flight(tiny_model_dir):
    engine = EngineProcess(config(tiny_model_dir("llama"), "off", "cpu")).start()
    try:
        stream = engine.submit(GenerationRequest("k", prompt_ids=[5, 6, 7], sampling=ENDLESS))
        next(iter(stream))
        os.kill(engine.pid, signal.SIGKILL)
        result = stream.result(timeout=30)
        assert result.finish_reason == FinishReason.ERROR and "exited" in result.error
        deadline = time.time() + 10
        while not engine.died and time.time() < deadline:
            time.sleep(0.05)
        assert engine.died and not engine.healthy
        with pytest.raises(EngineUnavailable, match="not serving"):
            engine.submit(GenerationRequest("k2", prompt_ids=[5]))
    finally:
        engine.shutdown()


def test_shutdown_ends_requests_and_leaves_nothing(tiny_model_dir):
    before = {t.name for t in threading.enumerate()}
    engine = EngineProcess(config(tiny_model_dir("llama"), "off", "cpu")).start()
    stream = engine.submit(GenerationRequest("s", prompt_ids=[5, 6, 7], sampling=ENDLESS))
    next(iter(stream))
    pid = engine.pid
    engine.shutdown()
    result = stream.result(timeout=30)
    assert result.finish_reason == FinishReason.ERROR and "shut down" in result.error
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # NOTE: exited and reaped
    assert {t.name for t in threading.enumerate()} <= before
    with pytest.raises(EngineUnavailable):
        engine.submit(GenerationRequest("s2", prompt_ids=[5]))


def test_a_load_error_is_raised_by_start(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        EngineProcess(EngineConfig(model=str(tmp_path), device="cpu")).start()


def test_a_load_error_that_does_not_unpickle_still_names_itself():
    from hsserve.engine.process_child import _portable

    err = RequestError("text_input", "bad")  # NOTE: its __init__ takes two arguments
    got = _portable(err)
    assert isinstance(got, RuntimeError) and "RequestError" in str(got) and "bad" in str(got)
    plain = ConfigError("model: no config.json")
    assert _portable(plain) is plain
