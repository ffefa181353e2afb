"""Issue 29 on the CPU: MoE routes each row alone, caching changes nothing, bad configs refused.

Issue 29 on the CPU: mixture of experts (Mixtral, Qwen3-MoE): routing is a row's own (a tie
included, whatever else is in the batch); the prefix cache and chunked prefill change nothing (MoE,
Gemma 2 / 3's two windows, Phi-3); configs we would compute wrongly are refused by field; Phi-3's
long-rope frequencies and attention factor are transformers'; Gemma 3's final soft-capping shows
in logprobs. (Tokens and rows against transformers, alone and batched, for every family:
test_engine_parity.py.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from hsserve.models.moe import MoE
from hsserve.models.spec import ModelSpec
from oracle import hf_greedy, hf_hidden, max_rel_row_diff


def moe_spec(**over) -> ModelSpec:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 16,
           "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    return ModelSpec.from_hf_dict({**cfg, **over})


def test_routing_is_each_rows_own_even_on_a_tie():
    torch.manual_seed(0)
    moe = MoE(moe_spec())
    for p in (moe.router, moe.gate_up, moe.down):
        p.data.normal_()
    moe.router.data[3] = moe.router.data[1]  # NOTE: experts 1 and 3 tie on every token
    x = torch.randn(9, 16)
    x[4] = moe.router.data[1] * 5  # NOTE: a row whose best two are exactly the tied pair
    weights, experts = moe.route(x)
    assert sorted(experts[4].tolist()) == [1, 3] and weights[4, 0] == weights[4, 1]
    batched = moe(x)
    for i in range(len(x)):
        w, e = moe.route(x[i : i + 1])
        assert torch.equal(e[0], experts[i]) and torch.allclose(w[0], weights[i], atol=1e-7)
        assert torch.allclose(moe(x[i : i + 1])[0], batched[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("over, field", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_configs_we_cannot_compute_are_refused_by_field(over, field):
    with pytest.raises(ValueError, match=field):
        moe_spec(**over)


@pytest.mark.parametrize("over, field", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),  # NOTE: Gemma 2's, not 3's
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_gemma_configs_we_cannot_compute_are_refused_by_field(tiny_model_dir, over, field):
    cfg = json.load(open(os.path.join(tiny_model_dir("gemma3"), "config.json")))
    spec = ModelSpec.from_hf_dict(cfg)
    assert spec.layer_windows == (24, None, 24) and spec.rope_local["rope_theta"] == 1e4
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_dict({**cfg, **over})


def test_dense_layers_of_a_moe_model():
    spec = moe_spec(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2)
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3"])
def test_prefix_cache_and_chunked_prefill_equal_transformers(family, tiny_model_dir, hf_model):
    folder = tiny_model_dir(family)
    hf = hf_model(folder)
    prefix = [(37 * i) % 40000 + 50 for i in range(30)]
    prompts = [prefix + [900 + i] * (2 + 3 * i) for i in range(3)] + [prefix + list(range(1000, 1045))]
    engine = Engine(EngineConfig(model=folder, device="cpu", block_size=4, max_num_seqs=8,
                                 max_num_batched_tokens=16)).start()
    try:
        for round_ in range(2):  # NOTE: the second round finds every prefix cached
            hits = engine.pool.num_hit_tokens
            reqs = [GenerationRequest(f"{family}{round_}-{i}", prompt_ids=p,
                                      sampling=SamplingParams(max_tokens=6, temperature=0.0),
                                      hidden_mode=HiddenStatesMode.LAST, hidden_layers=(0, 1, -1))
                    for i, p in enumerate(prompts)]
            results = [s.result(timeout=300) for s in [engine.submit(r) for r in reqs]]
            for req, res in zip(reqs, results):
                assert res.token_ids == hf_greedy(hf, req.prompt_ids, 6, 2)
                ref = hf_hidden(hf, req.prompt_ids + res.token_ids, req.hidden_layers)[-1:]
                assert max_rel_row_diff(res.hidden, ref, 3) <= 1e-3
            if round_:
                assert engine.pool.num_hit_tokens - hits >= 28 * len(prompts)
        assert engine.pool.num_free == engine.pool.num_blocks
    finally:
        engine.shutdown()


def test_the_experts_checkpoint_names_are_required(tiny_model_dir, tmp_path):
    """A checkpoint missing one expert's tensor is refused naming it (not loaded half-random)."""
    from safetensors.torch import load_file, save_file

    folder = tiny_model_dir("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    [name] = [f for f in os.listdir(broken) if f.endswith(".safetensors")]
    tensors = load_file(str(broken / name))
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[gone]
    save_file(tensors, str(broken / name), metadata={"format": "pt"})
    assert json.load(open(broken / "config.json"))["num_local_experts"] == 4
    with pytest.raises(KeyError, match="experts.3.w2"):
        Engine(EngineConfig(model=str(broken), device="cpu")).start()


def test_longrope_frequencies_and_attention_factor_equal_transformers(tiny_model_dir):
    """Phi-3's long-rope checkpoints: within the original length, the short factors and the
    attention factor (applied here as its square on the softmax scale) are transformers'."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hsserve.models.rope import attention_factor, inverse_frequencies

    folder = tiny_model_dir("phi3")
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](AutoConfig.from_pretrained(folder), "cpu")
    spec = ModelSpec.from_folder(folder)
    assert torch.equal(inverse_frequencies(spec.head_dim, spec.rope), inv)
    assert factor > 1.05 and attention_factor(spec.rope) == pytest.approx(factor, rel=1e-12)
    assert spec.max_position_embeddings == 256, "served within the original length"
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelSpec.from_hf_dict({**json.load(open(os.path.join(folder, "config.json"))),
                                "partial_rotary_factor": 0.75})


def test_gemma3_logprobs_see_the_final_soft_capping(tiny_model_dir, hf_model):
    """Gemma 3's final logit soft-capping leaves greedy tokens alone but not log-probabilities:
    they equal transformers' (which caps), greedy and sampled."""
    from test_logprobs import check

    folder = tiny_model_dir("gemma3")
    hf = hf_model(folder)
    engine = Engine(EngineConfig(model=folder, device="cpu")).start()
    try:
        prompt = [5, 6, 7, 8, 9]
        for sp in (SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3),
                   SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
                                  logprobs=2)):
            res = engine.generate(GenerationRequest(f"g{sp.temperature}", prompt_ids=prompt,
                                                    sampling=sp), timeout=120)
            check(res, prompt, hf, sp.logprobs)
            assert max(abs(e.logprob) for e in res.logprobs) > 0.5, "peaked enough to tell"
    finally:
        engine.shutdown()
