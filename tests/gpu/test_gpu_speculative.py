"""On CUDA (pytest -m gpu): n-gram drafts give transformers' tokens and rows beside the graph path.

A batch of repetitive prompts (drafts get accepted) with MODE full / last / none, on an engine
with speculative_method ngram whose decodes and verify steps replay the CUDA graphs (captured at
start only): float32 greedy tokens equal transformers' and rows within 1e-3 of the row norm;
bfloat16 rows of the same tokens with cosine >= 0.999 against a float32 transformers forward;
nothing is left in the pool."""

from __future__ import annotations

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from oracle import hf_greedy, hf_hidden, max_rel_row_diff, min_layer_cosine
from tiny_models import save_gpu_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
MODES = (HiddenStatesMode.FULL, HiddenStatesMode.LAST, HiddenStatesMode.NONE)
LAYERS = (0, 2, -1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_gpu_llama(str(tmp_path_factory.mktemp("spec-llama")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_ngram_drafts_keep_tokens_and_rows(tiny_llama, dtype, verified_in_graphs):
    from transformers import AutoModelForCausalLM

    verified = verified_in_graphs
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1000, (5 + i,), generator=g).tolist() * (3 + i % 2)
               for i in range(6)]
    engine = Engine(EngineConfig(model=tiny_llama, device="cuda", dtype=dtype, max_num_seqs=8,
                                 speculative_method="ngram", num_speculative_tokens=4,
                                 ngram_min=1)).start()
    try:
        streams = [engine.submit(GenerationRequest(
            f"s{i}", prompt_ids=p, hidden_mode=MODES[i % 3],
            hidden_layers=LAYERS if MODES[i % 3] is not HiddenStatesMode.NONE else None,
            sampling=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
            for i, p in enumerate(prompts)]
        results = [s.result(timeout=300) for s in streams]
        captures = engine.executor.graphs.num_captures, len(engine.executor.graphs.graphs)
        accepted = engine.stats.accepted_tokens
    finally:
        engine.shutdown()
    assert accepted > 0, "repetitive prompts accept drafts"
    assert engine.pool.num_free == engine.pool.num_blocks
    assert sum(verified) >= 10, "verify steps replay the decode graphs"
    assert captures[0] == captures[1], "nothing captured while serving"
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert len(r.token_ids) == 24
        if dtype == "float32":
            assert r.token_ids == hf_greedy(hf, p, 24, 2, min_new_tokens=24)
        if MODES[i % 3] is HiddenStatesMode.NONE:
            continue
        ref = hf_hidden(hf, p + r.token_ids, LAYERS)
        ref = ref if MODES[i % 3] is HiddenStatesMode.FULL else ref[-1:]
        assert r.hidden.shape == ref.shape
        if dtype == "float32":
            assert max_rel_row_diff(r.hidden, ref, len(LAYERS)) <= 1e-3
        else:
            cos = min_layer_cosine(r.hidden, ref, 3)
            assert cos >= 0.999, cos
