"""Async scheduling (a step queued before the last is read) changes nothing a client sees.

Async scheduling (a decode step queued before the previous one is read) changes nothing a client
sees (async_cases). On the CPU the steps do not overlap in time, but the engine takes the same
path: steps queued ahead, their inputs read from the device, void samples of stopped sequences,
the last token's row taken from the step ahead, preemption after draining."""

from __future__ import annotations

from async_cases import check_async_equals_sync


def test_async_equals_sync(tiny_model_dir):
    check_async_equals_sync(tiny_model_dir("llama"), "cpu", vocab=40000, tol=1e-4)


def test_rows_of_last_tokens_do_not_stop_steps_queued_ahead(tiny_model_dir):
    """Sequences ending at different steps: the step that only computes an ended sequence's last
    row (MODE last / full) does not keep the others from being queued ahead, so a batch takes as
    many steps that wait for the previous one (not queued ahead) as it does in MODE=none."""
    from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                 async_scheduling="on")).start()
    waited = {}
    try:
        for mode in HiddenStatesMode:
            steps, ahead = engine.num_steps, engine.num_ahead_steps
            streams = [engine.submit(GenerationRequest(
                f"{mode.label}{i}", prompt_ids=[100 + i] * (5 + i),
                sampling=SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True),
                hidden_mode=mode)) for i in range(4)]
            results = [s.result(timeout=120) for s in streams]
            assert [len(r.token_ids) for r in results] == [4, 8, 12, 16]
            if mode == HiddenStatesMode.LAST:
                assert all(r.hidden.shape[0] == 1 for r in results)
            waited[mode] = (engine.num_steps - steps) - (engine.num_ahead_steps - ahead)
    finally:
        engine.shutdown()
    assert waited[HiddenStatesMode.LAST] == waited[HiddenStatesMode.NONE], waited
    assert waited[HiddenStatesMode.FULL] == waited[HiddenStatesMode.NONE], waited


def test_last_mode_stream_carries_the_last_token_with_its_row_in_the_final_delta(tiny_model_dir):
    """MODE=last, streamed, the row computed one step after the last token was sampled: that
    token is not sent on its own but with its row in the final delta, whether the end was known
    by length or decided by a sampled stop token; every token exactly once, in order."""
    import threading

    from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

    for mode in ("on", "off"):
        engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                     async_scheduling=mode)).start()
        try:
            plain = engine.generate(GenerationRequest(
                "plain", prompt_ids=[7, 8, 9], sampling=SamplingParams(max_tokens=9,
                                                                      temperature=0.0)))
            stop_at = plain.token_ids[5]
            for name, sp in (("length", dict(max_tokens=9)),
                             ("stop", dict(max_tokens=9, stop_token_ids=(stop_at,)))):
                deltas, done = [], threading.Event()

                def sink(delta, deltas=deltas, done=done):
                    deltas.append(delta)
                    if delta.finish_reason is not None:
                        done.set()
                engine.submit(GenerationRequest(
                    f"{mode}-{name}", prompt_ids=[7, 8, 9], hidden_mode=HiddenStatesMode.LAST,
                    sampling=SamplingParams(temperature=0.0, **sp)), sink=sink)
                assert done.wait(120)
                want = plain.token_ids[: plain.token_ids.index(stop_at) + 1] \
                    if name == "stop" else plain.token_ids
                *early, final = deltas
                assert [t for d in deltas for t in d.token_ids] == want, (mode, name)
                assert final.token_ids == want[-1:], (mode, name, "the last token, with its row")
                assert final.hidden is not None and final.hidden.shape[0] == 1
                assert all(d.hidden is None and d.finish_reason is None for d in early)
        finally:
            engine.shutdown()
