"""Real model shapes for benchmarks with random weights (EngineConfig.load_format = "dummy").

Only a config.json is written (no weights travel): the engine fills the tensors at random.
"""

from __future__ import annotations

import json
import os

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

SHAPES = {
    "llama-1b": dict(  # Llama-3.2-1B
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
        tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_id=128001,
    ),
    "llama-8b": dict(  # Llama-3.1-8B
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=128001,
    ),
    "llama-70b": dict(  # Llama-3.1-70B (tensor parallel: bench/gpu_session.sh tp)
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
        tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=128001,
    ),
    "qwen3-30b-a3b": dict(  # Qwen3-30B-A3B: 128 experts, 8 a token
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=151645,
    ),
}


def random_model(name: str, root: str = "") -> str:
    """A folder holding the shape's config.json; load it with load_format="dummy"."""
    folder = os.path.join(root or os.path.expanduser("~/.cache/hsserve/shapes"), name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(SHAPES[name], f, indent=1)
    return folder
