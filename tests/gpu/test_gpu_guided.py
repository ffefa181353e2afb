"""On CUDA (pytest -m gpu): guided decoding through the CUDA-graph decode path (Issue 45 item 1).

Greedy requests under a regex and under choices, batched with plain ones, on a tiny random Llama
with a byte-level BPE tokenizer: their text matches, decode steps replay the graphs captured at
start (none captured later), and the rows of the chosen tokens are
transformers' (bf16 cosine >= 0.999 against float32)."""

from __future__ import annotations

import re

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from hsserve.request import GuidedDecoding
from oracle import hf_hidden
from tiny_models import byte_bpe_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PATTERN = r'\{"id": [0-9]{1,3}, "tag": "(red|blue|green)"\}'


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=2, bos_token_id=1)
    out = str(tmp_path_factory.mktemp("guided"))
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    byte_bpe_tokenizer(out, 512)
    return out


def test_gpu_guided_decode_in_graphs_with_exact_rows(folder):
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=folder, device="cuda", dtype="bfloat16",
                                 max_num_seqs=8)).start()
    kinds = [{"regex": PATTERN}, {"choice": ["alpha", "beta gamma", "delta"]}] * 3
    try:
        captures, replays = engine.num_graph_captures, engine.executor.num_graph_steps
        streams = [engine.submit(GenerationRequest(
            f"g{i}", prompt=f"Item {i}:", hidden_mode=HiddenStatesMode.FULL, hidden_layers=(-1,),
            sampling=SamplingParams(max_tokens=40, temperature=0.0,
                                    guided=GuidedDecoding.parse("guided_decoding", k))))
            for i, k in enumerate(kinds)]
        plain = [engine.submit(GenerationRequest(f"p{i}", prompt=f"Plain {i}",
                                                 sampling=SamplingParams(max_tokens=30,
                                                                         ignore_eos=True)))
                 for i in range(2)]
        results = [s.result(timeout=300) for s in streams]
        assert all(len(s.result(timeout=300).token_ids) == 30 for s in plain)
        assert engine.num_graph_captures == captures
        assert engine.executor.num_graph_steps >= replays + 20
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    for k, r in zip(kinds, results):
        if "regex" in k:
            assert re.fullmatch(PATTERN, r.text), r.text
        else:
            assert r.text in k["choice"], r.text
        ids = engine.tokenizer(f"Item {results.index(r)}:").input_ids + r.token_ids
        ref = hf_hidden(hf, ids, (4,))
        cos = torch.nn.functional.cosine_similarity(r.hidden, ref, dim=-1)
        assert r.hidden.shape == ref.shape and float(cos.min()) >= 0.999, float(cos.min())
