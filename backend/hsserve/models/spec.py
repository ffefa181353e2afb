"""ModelSpec: the shape of a decoder, read once from an HF config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def _moe_fields(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixture-of-experts shape (none for dense families); a config we would compute wrongly is
    refused by its field."""
    if family == "mixtral":
        experts, inter, renorm, dense = cfg["num_local_experts"], cfg["intermediate_size"], True, ()
    elif family == "qwen3_moe":
        # NOTE: Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        inter = cfg["moe_intermediate_size"]
        renorm = bool(cfg.get("norm_topk_prob", False))
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(cfg["num_hidden_layers"])
                      if i in only or experts == 0 or (i + 1) % step != 0)
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError("shared_expert_intermediate_size: shared experts are not supported")
    else:
        return {}
    top = int(cfg["num_experts_per_tok"])
    if not 0 < top <= experts:
        raise ValueError(f"num_experts_per_tok: {top} must be within 1..{experts} (the experts)")
    return dict(num_experts=int(experts), experts_per_token=top, moe_intermediate_size=int(inter),
                norm_topk_prob=renorm, dense_layers=dense)


def _rope_of(params: dict[str, Any] | None, theta: float) -> dict[str, Any]:
    rope = dict(params or {})
    rope.setdefault("rope_theta", theta)
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def _gemma_fields(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 (text): scaled embeddings, (1 + w) norms, four norms a layer, a gelu
    MLP, its own attention scale, sliding and full layers (Gemma 3: with a rope of each kind),
    final logit soft-capping (Gemma 2: attention soft-capping too); what we would compute wrongly
    is refused by field."""
    if family not in ("gemma2", "gemma3"):
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: True is not supported")
    if family == "gemma3" and cfg.get("attn_logit_softcapping"):
        raise ValueError(f"attn_logit_softcapping: {cfg['attn_logit_softcapping']!r} is not "
                         "supported for Gemma 3")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation: {act!r} is not supported; supported: 'gelu_pytorch_tanh'")
    n = cfg["num_hidden_layers"]
    pattern = int(cfg.get("sliding_window_pattern", 6 if family == "gemma3" else 2))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(n)]
    params = cfg.get("rope_parameters") or {}
    if family == "gemma2":  # NOTE: one rope for every layer
        full = params or {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e4)}
        local = None
    elif "full_attention" in params:  # NOTE: transformers 5's form; checkpoints carry the older
        full, local = params["full_attention"], params.get("sliding_attention")
    else:
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    window = cfg.get("sliding_window")
    return dict(
        rope=_rope_of(full, 1e6), rope_local=_rope_of(local, 1e4) if local is not None else None,
        attn_softcap=cfg.get("attn_logit_softcapping") if family == "gemma2" else None,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        embed_scale=float(cfg["hidden_size"]) ** 0.5, gemma_norms=True, activation="gelu_tanh",
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        logit_softcap=cfg.get("final_logit_softcapping"),
    )


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    rope: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    num_experts: int = 0  # NOTE: 0: a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # NOTE: the chosen experts' weights renormalized to sum to 1
    dense_layers: tuple[int, ...] = ()  # NOTE: of a MoE model, the layers with a plain MLP
    # NOTE: Gemma 3's (defaults: the Llama family's)
    rope_local: dict[str, Any] | None = None  # rope of the sliding layers, when it differs
    layer_windows: tuple[int | None, ...] = ()  # per layer, when they differ (else sliding_window)
    embed_scale: float = 1.0
    gemma_norms: bool = False  # (1 + w) weights; post-attention, pre- and post-feed-forward norms
    activation: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    logit_softcap: float | None = None
    attn_softcap: float | None = None  # NOTE: Gemma 2: cap * tanh(scores / cap) before the mask

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None):
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {arch!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = cfg.get("hidden_act", "silu")
        if act != "silu" and family not in ("gemma2", "gemma3"):
            raise ValueError(f"hidden_act: {act!r} is not supported; supported: 'silu'")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        rope.setdefault("rope_type", rope.get("type", "default"))
        max_pos = cfg.get("max_position_embeddings", 2048)
        partial = (rope.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"))
        if any(p is not None and float(p) != 1.0 for p in partial):
            raise ValueError("partial_rotary_factor: only 1.0 (rotary over the whole head) is supported")
        if rope["rope_type"] == "longrope":
            rope.setdefault("original_max_position_embeddings",
                            cfg.get("original_max_position_embeddings", max_pos))
            rope.setdefault("factor", max_pos / rope["original_max_position_embeddings"])
            # NOTE: transformers switches a sequence to the long factors past the original
            # length, inconsistently (a cached prefix keeps the short ones): served within it
            max_pos = min(max_pos, int(rope["original_max_position_embeddings"]))
        window = cfg.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3_moe"):
            window = window if cfg.get("use_sliding_window", False) else None
        gemma = _gemma_fields(family, cfg)
        if gemma:
            rope, window = gemma.pop("rope"), None  # NOTE: windows per layer
        eos: list[int] = []
        for src in (cfg, generation_cfg or {}):
            val = src.get("eos_token_id")
            for e in val if isinstance(val, list) else [val]:
                if e is not None and e not in eos:
                    eos.append(int(e))
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            sliding_window=window,
            rope=rope,
            eos_token_ids=tuple(eos),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **_moe_fields(family, cfg),
            **gemma,
        )

    @classmethod
    def from_folder(cls, path: str) -> ModelSpec:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        gen = None
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf_dict(cfg, gen)

    def normalize_layer(self, k: int) -> int:
        """HF hidden_states index -> 0..L (L = final layer after the final norm)."""
        n = self.num_layers + 1
        if not -n <= k < n:
            raise ValueError(f"layer {k} outside -{n}..{n - 1}")
        return k % n

    @property
    def kv_elems_per_token(self) -> int:
        """Elements of K+V per token over all layers (times the element size = bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim
