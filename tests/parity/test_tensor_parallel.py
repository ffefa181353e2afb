"""Tensor parallelism on the CPU (gloo, 2 ranks) equals one rank; cancels and dead ranks clean up.

Issue 27 on the CPU (gloo, 2 ranks): tensor_parallel_size 2 gives the tokens of one rank and
its hidden rows within 1e-4 of the row norm (several families, K/V heads fewer than the ranks, a
vocabulary the ranks do not divide; SmolLM2's 3 K/V heads shared out 2 + 1), through prefix-cache
hits and chunked prefill; a cancel frees what it held; a rank that dies fails the engine as a
crash does; nothing outlives it."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest
import torch

from tiny_models import tiny_config
from hsserve import (Engine, EngineConfig, EngineUnavailable, FinishReason, GenerationRequest,
                     HiddenStatesMode, SamplingParams)
from hsserve.engine.config import ConfigError
from hsserve.engine.process import EngineProcess
from oracle import max_rel_row_diff

TOL = 1e-4
LAYERS = [(0, 1, -1), (-2,), (2, 3)]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "qwen3_moe")


@pytest.fixture(scope="module")
def few_kv_heads_dir(tmp_path_factory):
    """One K/V head for two ranks (replicated), tied embeddings, a vocabulary of odd size."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings = 1, 49155, True
    torch.manual_seed(7)
    folder = str(tmp_path_factory.mktemp("tiny-kv1"))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def requests(tag: str) -> list[GenerationRequest]:
    """Mixed lengths and modes; two share a 40-token prefix (a cache hit in the second round)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 40000, (40,), generator=g).tolist()
    prompts = [shared + [11, 12], torch.randint(3, 40000, (7,), generator=g).tolist(),
               shared + [13], torch.randint(3, 40000, (70,), generator=g).tolist()]
    modes = [HiddenStatesMode.FULL, HiddenStatesMode.LAST, HiddenStatesMode.FULL,
             HiddenStatesMode.NONE]
    return [GenerationRequest(f"{tag}-{i}", prompt_ids=p,
                              sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                              hidden_mode=m, hidden_layers=LAYERS[i % 3] if m else None)
            for i, (p, m) in enumerate(zip(prompts, modes))]


def run_twice(folder: str, tp: int):
    """Two rounds (the second hits the prefix cache), prompts chunked by a 32-token budget."""
    engine = Engine(EngineConfig(model=folder, device="cpu", tensor_parallel_size=tp,
                                 max_num_seqs=4, max_num_batched_tokens=32,
                                 num_kv_blocks=64)).start()
    try:
        out = []
        for r in range(2):
            streams = [engine.submit(q) for q in requests(f"r{r}")]
            out += [s.result(timeout=120) for s in streams]
        assert engine.pool.num_hit_tokens > 0
        return out
    finally:
        engine.shutdown()


def assert_same(one, two):
    for j, (a, b) in enumerate(zip(one, two, strict=True)):
        assert a.token_ids == b.token_ids
        if a.hidden is None:
            assert b.hidden is None
            continue
        assert max_rel_row_diff(b.hidden, a.hidden, len(LAYERS[j % 4 % 3])) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one(family, tiny_model_dir):
    folder = tiny_model_dir(family)
    assert_same(run_twice(folder, 1), run_twice(folder, 2))


def test_two_ranks_equal_one_with_fewer_kv_heads_than_ranks(few_kv_heads_dir):
    assert_same(run_twice(few_kv_heads_dir, 1), run_twice(few_kv_heads_dir, 2))


def test_two_ranks_equal_one_on_the_default_model(smollm_dir):
    assert_same(run_twice(smollm_dir, 1), run_twice(smollm_dir, 2))


def test_a_size_the_model_does_not_split_by_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 3 does not split the model's 4 attention heads over 2"):
        Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                            tensor_parallel_size=3)).start()
    with pytest.raises(ConfigError, match="tensor_parallel_size: must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


ENDLESS = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _pids(engine: Engine) -> list[int]:
    return [p.pid for p in engine.executor.peers._procs]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # NOTE: a zombie is gone too (not yet reaped)
        return f.read().split(")")[-1].split()[0] == "Z"


def test_cancel_frees_the_blocks_and_the_ranks_stop_with_the_engine(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                 tensor_parallel_size=2, num_kv_blocks=64)).start()
    pids = _pids(engine)
    try:
        stream = engine.submit(GenerationRequest("c", prompt_ids=[5, 6, 7], sampling=ENDLESS))
        next(iter(stream))
        engine.abort("c")
        assert stream.result(timeout=30).finish_reason == FinishReason.CANCELLED
        deadline = time.time() + 10
        while engine.pool.num_used - engine.pool.num_cached and time.time() < deadline:
            time.sleep(0.05)
        assert engine.pool.num_used == engine.pool.num_cached  # NOTE: only cached blocks stay
        ok = engine.generate(GenerationRequest("d", prompt_ids=[5, 6, 7], sampling=SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True)), timeout=60)
        assert len(ok.token_ids) == 4
    finally:
        engine.shutdown()
    assert all(_gone(p) for p in pids)


def test_a_rank_that_dies_fails_the_engine_as_a_crash(tiny_model_dir):
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                 tensor_parallel_size=2, num_kv_blocks=64)).start()
    try:
        stream = engine.submit(GenerationRequest("k", prompt_ids=[5, 6, 7], sampling=ENDLESS))
        next(iter(stream))
        os.kill(_pids(engine)[0], signal.SIGKILL)
        result = stream.result(timeout=30)
        assert result.finish_reason == FinishReason.ERROR and "rank 1 exited" in result.error
        deadline = time.time() + 10
        while not engine.died and time.time() < deadline:
            time.sleep(0.05)
        assert engine.died and not engine.healthy
        with pytest.raises(EngineUnavailable):
            engine.submit(GenerationRequest("k2", prompt_ids=[5]))
    finally:
        engine.shutdown()


def test_the_ranks_die_with_a_killed_engine_process(tiny_model_dir):
    engine = EngineProcess(EngineConfig(model=tiny_model_dir("llama"), device="cpu",
                                        tensor_parallel_size=2, num_kv_blocks=64)).start()
    try:
        ranks = []
        for task in glob.glob(f"/proc/{engine.pid}/task/*/children"):  # NOTE: by any thread
            with open(task) as f:
                ranks += [int(p) for p in f.read().split()]
        assert ranks, "rank 1 is a child of the engine process"
        stream = engine.submit(GenerationRequest("p", prompt_ids=[5, 6, 7], sampling=ENDLESS))
        next(iter(stream))
        os.kill(engine.pid, signal.SIGKILL)
        assert stream.result(timeout=30).finish_reason == FinishReason.ERROR
        deadline = time.time() + 10
        while not all(_gone(p) for p in ranks) and time.time() < deadline:
            time.sleep(0.05)
        assert all(_gone(p) for p in ranks)
    finally:
        engine.shutdown()
