"""On CUDA (pytest -m gpu): the engine equals transformers; graphs, cache, async change nothing.

The engine against transformers on tiny random models; also the prefix cache warm equals cold,
graphs captured once equal eager over 1000 steps (logprobs too), async equals sync, no kernel is
compiled while serving, and memory returns after shutdown.

float32: greedy tokens equal and rows within 1e-3 of the row norm; bfloat16: rows of the same
tokens with cosine >= 0.999 against a float32 transformers forward (SPEC tolerance)."""

from __future__ import annotations

import threading

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from oracle import hf_greedy, hf_hidden, max_rel_row_diff, min_layer_cosine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    out = {}
    common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=2, bos_token_id=1)
    for name, cfg in [("llama", LlamaConfig(**common)), ("qwen3", Qwen3Config(**common, head_dim=32))]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        folder = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(folder)
        out[name] = folder
    return out


def run(engine, prompts, mode, layers, max_new):
    streams = [engine.submit(GenerationRequest(
        f"g{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=max_new, temperature=0.0),
        hidden_mode=mode, hidden_layers=layers if mode else None)) for i, p in enumerate(prompts)]
    return [s.result(timeout=300) for s in streams]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_engine_matches_transformers(tiny_dirs, family, dtype):
    from transformers import AutoModelForCausalLM

    folder = tiny_dirs[family]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 7, 16, 33, 70, 5)]
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype=dtype, block_size=16)).start()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    layers = (0, 2, -1)
    try:
        results = run(engine, prompts, HiddenStatesMode.FULL, layers, 12)
    finally:
        engine.shutdown()
    assert engine.pool.num_free == engine.pool.num_blocks
    for p, r in zip(prompts, results):
        ref = hf_hidden(hf, p + r.token_ids, layers)
        assert r.hidden.shape == ref.shape
        if dtype == "float32":
            assert r.token_ids == hf_greedy(hf, p, 12, 2)
            assert max_rel_row_diff(r.hidden, ref, len(layers)) <= 1e-3
        else:
            cos = min_layer_cosine(r.hidden, ref, 3)
            assert cos >= 0.999, cos


@pytest.mark.parametrize("mode", list(HiddenStatesMode))
def test_gpu_prefix_cache_warm_equals_cold(tiny_dirs, mode):
    """Issue 5 acceptance 1 on CUDA (float32): shared prefixes, a complete hit, chunked prompts,
    n = 4 seeded samples: the warm engine's second round equals a cold engine."""
    folder = tiny_dirs["llama"]
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 1000, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 9, 30)]
    prompts += [prefix[:32], prefix + list(range(100, 180))]
    sp = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=4, ignore_eos=True)]

    def run_all(engine, tag):
        streams = [engine.submit(GenerationRequest(f"{tag}{i}-{j}", prompt_ids=p, sampling=s,
                                                   hidden_mode=mode,
                                                   hidden_layers=(0, -1) if mode else None))
                   for i, p in enumerate(prompts) for j, s in enumerate(sp)]
        return [r for s in streams for r in s.results(timeout=300)]

    cold = Engine(EngineConfig(model=folder, device="cuda", dtype="float32",
                               enable_prefix_caching=False)).start()
    try:
        want = run_all(cold, "c")
    finally:
        cold.shutdown()
    warm = Engine(EngineConfig(model=folder, device="cuda", dtype="float32",
                               max_num_batched_tokens=64)).start()
    try:
        run_all(warm, "w1")
        hits = warm.pool.num_hit_tokens
        got = run_all(warm, "w2")
        if mode != HiddenStatesMode.FULL:
            assert warm.pool.num_hit_tokens > hits
        assert warm.pool.num_used == 0
    finally:
        warm.shutdown()
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        if b.hidden is not None:
            assert a.hidden.shape == b.hidden.shape
            assert torch.allclose(a.hidden, b.hidden, rtol=0, atol=1e-4)


def test_gpu_memory_returns_after_shutdown(tiny_dirs):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    engine = Engine(EngineConfig(model=tiny_dirs["llama"], device="cuda", num_kv_blocks=4096)).start()
    engine.generate(GenerationRequest("m", prompt_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=3)))
    assert torch.cuda.memory_allocated() > base + (8 << 20)  # weights + 4096 blocks of KV
    engine.shutdown()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= base + (1 << 20)


def test_gpu_graphs_captured_once_equal_eager_over_1000_steps(tiny_dirs):
    """Decode runs through CUDA graphs captured at start (plain and with rows, per batch size);
    MODE none / last / full alternate for 1000+ steps, the capture counter never moves, and the
    outputs equal the eager engine's."""
    from hsserve.engine.cuda_graphs import batch_ladder

    cfg = dict(model=tiny_dirs["llama"], device="cuda", dtype="float32", max_num_seqs=8)
    graph = Engine(EngineConfig(**cfg)).start()
    eager = Engine(EngineConfig(**cfg, enable_cuda_graph=False)).start()
    try:
        captures = graph.num_graph_captures
        assert captures == 2 * len(batch_ladder(8)) and eager.num_graph_captures == 0
        g = torch.Generator().manual_seed(9)
        modes = list(HiddenStatesMode)
        steps0, rounds = graph.num_steps, 0
        while graph.num_steps - steps0 < 1000:
            reqs = [GenerationRequest(
                f"r{rounds}-{i}",
                prompt_ids=torch.randint(3, 1000, (int(torch.randint(1, 40, (1,), generator=g)),),
                                         generator=g).tolist(),
                sampling=SamplingParams(max_tokens=int(torch.randint(1, 48, (1,), generator=g)),
                                        temperature=0.0, ignore_eos=True),
                hidden_mode=modes[(rounds + i) % 3],
                hidden_layers=(0, -1) if modes[(rounds + i) % 3] else None)
                for i in range(1 + rounds % 7)]
            got = [graph.submit(r) for r in reqs]
            got = [s.result(timeout=300) for s in got]
            if rounds < 6:
                want = [eager.generate(r, timeout=300) for r in reqs]
                for a, b in zip(got, want):
                    assert a.token_ids == b.token_ids
                    if b.hidden is not None:
                        assert torch.allclose(a.hidden, b.hidden, rtol=0, atol=1e-4)
            rounds += 1
        assert graph.num_graph_captures == captures
        assert graph.pool.num_used == 0
    finally:
        graph.shutdown()
        eager.shutdown()


def compiled_variants() -> dict[str, int]:
    """Per @triton.jit kernel of ours, how many variants Triton has compiled in this process.
    NOTE: reads JITFunction.device_caches (triton 3.6: device -> (kernel cache, ...)), not a
    public API: check it when Triton is upgraded."""
    import triton

    from hsserve.kernels import elementwise, paged_decode_attention, paged_prefill_attention

    out = {}
    for mod in (elementwise, paged_decode_attention, paged_prefill_attention):
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction) and fn.device_caches:
                out[f"{mod.__name__}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return out


def test_gpu_no_kernel_is_compiled_while_serving(tiny_dirs):
    """After the first mixed step, prompts of any length, batch and prefix-cache state compile no
    new kernel variant (a compile stalls the loop for a second): pointer alignment and the
    per-step integer arguments must not make Triton specialize."""
    engine = Engine(EngineConfig(model=tiny_dirs["llama"], device="cuda", dtype="bfloat16",
                                 max_num_seqs=8, block_size=16)).start()
    try:
        warm = [engine.submit(GenerationRequest(f"w{i}", prompt_ids=list(range(3, 3 + n)),
                                                sampling=SamplingParams(max_tokens=6)))
                for i, n in enumerate([5, 40])]
        [s.result(timeout=300) for s in warm]
        mixed = engine.num_mixed_steps
        before = compiled_variants()
        assert "hsserve.kernels.paged_prefill_attention._varlen_kernel" in before, before
        g = torch.Generator().manual_seed(3)
        ends = []
        for i in range(48):  # NOTE: 1..300-token prompts, each arriving while the last decodes
            n = int(torch.randint(1, 300, (1,), generator=g))
            ids = torch.randint(3, 1000, (n,), generator=g).tolist()
            if i % 5 == 0:
                ids = list(range(3, 3 + n))  # NOTE: prefix-cache hits of every length
            first, end = threading.Event(), threading.Event()
            engine.submit(GenerationRequest(
                f"r{i}", prompt_ids=ids,
                sampling=SamplingParams(max_tokens=int(i % 9) + 64, ignore_eos=True)),
                sink=lambda d, first=first, end=end: (d.token_ids and first.set(),
                                                      d.request_done and end.set()))
            assert first.wait(300)  # NOTE: decoding 64+ steps more: the next prompt mixes in
            ends.append(end)
        assert all(e.wait(300) for e in ends)
        assert engine.num_mixed_steps >= mixed + 47, engine.num_mixed_steps - mixed
        assert compiled_variants() == before
    finally:
        engine.shutdown()


@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_async_equals_sync(tiny_dirs, graphs):
    """Steps queued ahead (graph replays reading the previous samples on the device, or eager
    steps) give what the sync engine gives, float32."""
    from async_cases import check_async_equals_sync

    check_async_equals_sync(tiny_dirs["llama"], "cuda", vocab=1000, tol=1e-4, block_size=16,
                            dtype="float32", enable_cuda_graph=graphs)


def test_gpu_logprobs_through_the_graphs_equal_eager(tiny_dirs):
    """Logprobs of greedy decode steps (the graphs' own argmax) and sampled ones (the sampler
    after the replay) equal the eager engine's."""
    cfg = dict(model=tiny_dirs["llama"], device="cuda", dtype="float32", max_num_seqs=8)
    graph = Engine(EngineConfig(**cfg)).start()
    eager = Engine(EngineConfig(**cfg, enable_cuda_graph=False)).start()
    try:
        sps = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
               SamplingParams(max_tokens=10, temperature=0.8, seed=5, n=2, ignore_eos=True,
                              logprobs=2),
               SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
        reqs = [GenerationRequest(f"lp{i}", prompt_ids=list(range(5 + i, 20 + 3 * i)), sampling=sp)
                for i, sp in enumerate(sps * 2)]
        got = [r for s in [graph.submit(r) for r in reqs] for r in s.results(timeout=300)]
        want = [r for s in [eager.submit(r) for r in reqs] for r in s.results(timeout=300)]
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            if b.logprobs is None:
                assert a.logprobs is None
                continue
            assert [e.top_ids for e in a.logprobs] == [e.top_ids for e in b.logprobs]
            assert [e.rank for e in a.logprobs] == [e.rank for e in b.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert abs(x.logprob - y.logprob) <= 1e-4
        assert graph.num_graph_captures > 0
    finally:
        graph.shutdown()
        eager.shutdown()
