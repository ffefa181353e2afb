"""Provides tiny_config: a small random config of each family, for the tests' tiny models.

Small random configs of each family (SmolLM2's vocabulary, so text works): the tiny models
the tests make with transformers."""

from __future__ import annotations


def tiny_config(family: str):
    """A small random config of each family, using SmolLM2's vocabulary so text works."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=2,
    )
    if family == "llama":
        # Llama-3 style RoPE scaling, untied head
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if family == "phi3":  # NOTE: longrope (its short factors and attention factor), a window
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
                    short_factor=[1.0 + 0.1 * i for i in range(half)],
                    long_factor=[2.0 + 0.3 * i for i in range(half)])
        return Phi3Config(**common, rope_parameters=rope, sliding_window=40, initializer_range=0.25,
                          original_max_position_embeddings=256, tie_word_embeddings=False)
    if family == "gemma2":  # NOTE: attention and final soft-capping, alternating windows
        return Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                            initializer_range=0.25, attn_logit_softcapping=5.0,
                            final_logit_softcapping=30.0, tie_word_embeddings=True)
    if family == "gemma3":  # NOTE: sliding / full layers, their ropes (global linear x8), capping
        rope = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
        # NOTE: larger weights: peaked attention and logits, so the ropes and the capping show
        cfg = Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=24,
                               initializer_range=0.25,
                               layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention"],
                               rope_parameters=rope, final_logit_softcapping=30.0,
                               tie_word_embeddings=True)
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    if family == "mixtral":  # NOTE: 4 experts, 2 a token, renormalized; a sliding window
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=24, tie_word_embeddings=False)
    if family == "qwen3_moe":  # NOTE: 8 experts, 3 a token, not renormalized; layer 1 dense
        return Qwen3MoeConfig(**common, head_dim=32, num_experts=8, num_experts_per_tok=3,
                              moe_intermediate_size=48, norm_topk_prob=False,
                              mlp_only_layers=[1], tie_word_embeddings=False)
    raise ValueError(family)


def byte_bpe_tokenizer(folder: str, vocab_size: int, eos: str = "</s>") -> None:
    """Train a small byte-level BPE (every text encodable; no hub download) and save it into
    folder as a transformers tokenizer with `eos` at id 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "Ada", "age": 36}', "yes, no, red, blue, 0123456789", "The quick brown "
              "fox jumps over the lazy dog."] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos,
                            pad_token="<pad>").save_pretrained(folder)


def save_gpu_llama(folder: str) -> str:
    """The GPU tests' 4-layer Llama (vocab 1024, GQA 8 / 2), seeded, saved in folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder
