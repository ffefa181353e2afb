"""N-gram speculative decoding (issue 44): the same tokens, logprobs and hidden rows as without it.

Greedy and seeded tokens equal the plain engine's and transformers'; every hidden row (MODE full /
last, several layers) is the target's row of an accepted token, equal to transformers' within
1e-3 of the row norm; stops, length, n > 1, preemption, the prefix cache and cancel behave as
without speculation, and no KV block or row is left behind."""

from __future__ import annotations

import time

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from hsserve.request import FinishReason
from oracle import hf_greedy, hf_hidden, max_rel_row_diff

TOL = 1e-3
TEXT = ("The committee met on Tuesday to discuss the budget for the new library, which will open "
        "in the spring with a reading room, a cafe and a garden. ")
COPY = f"Repeat this text exactly:\n{TEXT}\nRepeated text:\n"
NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def spec_engine(smollm_dir):
    # NOTE: async scheduling on, as on CUDA: drafts still come (schedule_ahead steps aside)
    engine = Engine(EngineConfig(model=smollm_dir, device="cpu", max_num_seqs=8,
                                 async_scheduling="on", **NGRAM)).start()
    yield engine
    engine.shutdown()


def settled(engine, wait_s: float = 5.0) -> bool:
    """No KV block held and no row kept once every request has ended (the loop lets the rows go
    right after the final delta)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if engine.pool.num_used == 0 and len(engine.rows) == 0:
            return True
        time.sleep(0.01)
    return False


def run(engine, rid, prompt=COPY, **kw):
    mode, layers = kw.pop("hidden_mode", HiddenStatesMode.NONE), kw.pop("hidden_layers", None)
    sp = SamplingParams(**{"max_tokens": 40, "temperature": 0.0, **kw})
    req = GenerationRequest(rid, prompt=prompt, sampling=sp, hidden_mode=mode, hidden_layers=layers)
    return engine.submit(req).results(timeout=300)


def test_greedy_tokens_equal_plain_decoding_and_transformers_with_drafts_accepted(
        spec_engine, smollm_engine, hf_model, smollm_dir):
    accepted = spec_engine.stats.accepted_tokens
    ours, = run(spec_engine, "g")
    plain, = run(smollm_engine, "g-plain")
    assert spec_engine.stats.accepted_tokens - accepted >= 20, "the copy prompt accepts drafts"
    assert ours.token_ids == plain.token_ids and ours.text == plain.text
    prompt = spec_engine.tokenizer(COPY)["input_ids"]
    assert ours.token_ids == hf_greedy(hf_model(smollm_dir), prompt, 40,
                                       list(spec_engine.spec.eos_token_ids))


def test_seeded_sampling_and_n_completions_equal_plain_decoding(spec_engine, smollm_engine):
    kw = dict(temperature=0.8, top_p=0.95, top_k=50, seed=11, n=2, ignore_eos=True)
    ours = run(spec_engine, "s", **kw)
    plain = run(smollm_engine, "s-plain", **kw)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
    assert ours[0].token_ids != ours[1].token_ids


@pytest.mark.parametrize("mode", [HiddenStatesMode.FULL, HiddenStatesMode.LAST])
def test_hidden_rows_are_the_targets_rows_of_accepted_tokens(spec_engine, smollm_engine, hf_model,
                                                              smollm_dir, mode):
    layers = (0, 15, -1)
    ours, = run(spec_engine, f"h-{mode.value}", hidden_mode=mode, hidden_layers=layers)
    plain, = run(smollm_engine, f"h-plain-{mode.value}", hidden_mode=mode, hidden_layers=layers)
    assert ours.token_ids == plain.token_ids
    prompt = spec_engine.tokenizer(COPY)["input_ids"]
    ref = hf_hidden(hf_model(smollm_dir), prompt + ours.token_ids, layers)
    if mode is HiddenStatesMode.LAST:
        ref = ref[-1:]
    assert ours.hidden.shape == ref.shape == plain.hidden.shape
    assert max_rel_row_diff(ours.hidden, ref, len(layers)) <= TOL


def test_streamed_full_rows_come_with_their_own_tokens(spec_engine):
    req = GenerationRequest("st", prompt=COPY, hidden_mode=HiddenStatesMode.FULL,
                            sampling=SamplingParams(max_tokens=30, temperature=0.0))
    deltas = list(spec_engine.submit(req))
    prompt_len = deltas[0].num_input_tokens
    rows = sum(d.hidden.shape[0] for d in deltas if d.hidden is not None)
    tokens = sum(len(d.token_ids) for d in deltas)
    assert tokens == 30 and rows == prompt_len + tokens
    assert any(len(d.token_ids) > 1 for d in deltas), "a step accepted drafts: several tokens"
    for d in deltas[1:]:  # NOTE: after the prompt's rows, one row per token of the same delta
        assert (d.hidden.shape[0] if d.hidden is not None else 0) == len(d.token_ids)


def test_stop_ids_strings_and_length_end_where_plain_decoding_ends(spec_engine, smollm_engine):
    full, = run(smollm_engine, "ref")
    stop_id = full.token_ids[9]
    first = full.token_ids.index(stop_id)
    cases = [dict(stop_token_ids=(stop_id,)), dict(stop=("reading room",)), dict(max_tokens=7),
             dict(stop_token_ids=(stop_id,), hidden_mode=HiddenStatesMode.FULL)]
    for i, kw in enumerate(cases):
        ours, = run(spec_engine, f"stop{i}", **kw)
        plain, = run(smollm_engine, f"stop-plain{i}", **kw)
        assert (ours.token_ids, ours.text, ours.finish_reason) == (
            plain.token_ids, plain.text, plain.finish_reason), kw
        if kw.get("hidden_mode"):
            assert ours.hidden.shape[0] == ours.num_input_tokens + len(ours.token_ids)
    assert len(run(spec_engine, "s-id", stop_token_ids=(stop_id,))[0].token_ids) == first + 1
    assert run(spec_engine, "len", max_tokens=7)[0].finish_reason is FinishReason.LENGTH


def test_logprobs_are_the_targets_at_each_accepted_position(spec_engine, smollm_engine):
    ours, = run(spec_engine, "lp", logprobs=2)
    plain, = run(smollm_engine, "lp-plain", logprobs=2)
    assert ours.token_ids == plain.token_ids and len(ours.logprobs) == len(ours.token_ids)
    for a, b in zip(ours.logprobs, plain.logprobs):
        assert abs(a.logprob - b.logprob) <= 1e-4 and a.rank == b.rank and a.top_ids == b.top_ids


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir):
    """The tiny Llama with n-gram drafts in a pool small enough to preempt, and without."""
    folder = tiny_model_dir("llama")
    small = dict(model=folder, device="cpu", max_num_seqs=6, num_kv_blocks=14, block_size=16)
    spec = Engine(EngineConfig(**small, speculative_method="ngram", num_speculative_tokens=3,
                               ngram_min=1, ngram_max=3)).start()
    plain = Engine(EngineConfig(**small)).start()
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


def batch(engine, tag: str):
    g = torch.Generator().manual_seed(3)
    reqs = []
    for i in range(6):
        motif = torch.randint(3, 400, (6,), generator=g).tolist()
        mode = (HiddenStatesMode.FULL, HiddenStatesMode.LAST, HiddenStatesMode.NONE)[i % 3]
        reqs.append(GenerationRequest(
            f"{tag}{i}", prompt_ids=motif * (3 + i % 3), hidden_mode=mode,
            hidden_layers=(0, -1) if mode is not HiddenStatesMode.NONE else None,
            sampling=SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.9, seed=i,
                                    ignore_eos=True)))
    streams = [engine.submit(r) for r in reqs]
    return reqs, [s.result(timeout=300) for s in streams]


def test_a_preempting_batch_of_mixed_requests_equals_plain_decoding(tiny_pair, hf_model,
                                                                     tiny_model_dir):
    spec, plain = tiny_pair
    preempted, accepted = spec.scheduler.num_preemptions, spec.stats.accepted_tokens
    reqs, ours = batch(spec, "b")
    _, theirs = batch(plain, "p")
    assert spec.scheduler.num_preemptions > preempted, "the small pool preempts"
    assert spec.stats.accepted_tokens > accepted
    hf = hf_model(tiny_model_dir("llama"))
    for req, a, b in zip(reqs, ours, theirs):
        assert a.token_ids == b.token_ids, req.request_id
        if req.hidden_mode is HiddenStatesMode.NONE:
            continue
        ref = hf_hidden(hf, req.prompt_ids + a.token_ids, req.hidden_layers)
        ref = ref if req.hidden_mode is HiddenStatesMode.FULL else ref[-1:]
        assert max_rel_row_diff(a.hidden, ref, 2) <= TOL, req.request_id
    assert settled(spec)


def test_cancel_mid_draft_frees_everything_and_the_engine_goes_on(tiny_pair):
    spec, plain = tiny_pair
    req = GenerationRequest("c", prompt_ids=[7, 8, 9, 10] * 6, hidden_mode=HiddenStatesMode.FULL,
                            sampling=SamplingParams(max_tokens=300, temperature=0.0,
                                                    ignore_eos=True))
    stream = spec.submit(req)
    next(iter(stream))
    spec.abort("c")
    assert stream.result(timeout=60).finish_reason is FinishReason.CANCELLED
    again = dict(prompt_ids=[7, 8, 9, 10] * 6,
                 sampling=SamplingParams(max_tokens=12, temperature=0.0))
    a = spec.generate(GenerationRequest("c2", **again), timeout=60)
    b = plain.generate(GenerationRequest("c2p", **again), timeout=60)
    assert a.token_ids == b.token_ids
    assert settled(spec)
