"""Provides write_head (tiny random EAGLE-3 heads, both layouts) and reference_drafts (oracle).

The reference recomputes the whole sequence in plain torch, no cache: the oracle for
engine/drafter.py's drafts."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from oracle import hf_hidden


def write_head(folder: str, target_folder: str, layout: str = "specforge", seed: int = 0,
               draft_vocab: list[int] | None = None, own_embed: bool = False,
               std: float = 0.2, aux: list[int] | None = None) -> str:
    """A random head for the target in folder; layout 'specforge' (midlayer.*) or 'speculators'
    (layers.0.*, transformer_layer_config); draft_vocab: the target ids it drafts (default the
    first 512)."""
    with open(os.path.join(target_folder, "config.json")) as f:
        t = json.load(f)
    h, heads, kvh = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    hd, inter, n_layers = h // heads, t["intermediate_size"], t["num_hidden_layers"]
    vocab = draft_vocab if draft_vocab is not None else list(range(512))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    p = "midlayer." if layout == "specforge" else "layers.0."
    w = {"fc.weight": rnd(h, 3 * h), "norm.weight": 1 + rnd(h),
         "lm_head.weight": rnd(len(vocab), h),
         p + "input_layernorm.weight": 1 + rnd(h), p + "hidden_norm.weight": 1 + rnd(h),
         p + "post_attention_layernorm.weight": 1 + rnd(h),
         p + "self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
         p + "self_attn.k_proj.weight": rnd(kvh * hd, 2 * h),
         p + "self_attn.v_proj.weight": rnd(kvh * hd, 2 * h),
         p + "self_attn.o_proj.weight": rnd(h, heads * hd),
         p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
         p + "mlp.down_proj.weight": rnd(h, inter),
         "d2t": torch.tensor(vocab) - torch.arange(len(vocab)),
         "t2d": torch.zeros(t["vocab_size"], dtype=torch.bool).index_fill_(
             0, torch.tensor(vocab), True)}
    if own_embed:
        w["embed_tokens.weight"] = rnd(t["vocab_size"], h)
    layer = dict(hidden_size=h, num_attention_heads=heads, num_key_value_heads=kvh,
                 intermediate_size=inter, num_hidden_layers=1,
                 rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                 rope_theta=10000.0, max_position_embeddings=t["max_position_embeddings"],
                 vocab_size=t["vocab_size"], hidden_act="silu")
    if layout == "specforge":
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(vocab)}
        if aux is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
               "draft_vocab_size": len(vocab), "norm_before_residual": True,
               "eagle_aux_hidden_state_layer_ids": [n_layers, 1, n_layers - 1]}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat((f, f), -1).cos()[:, None], torch.cat((f, f), -1).sin()[:, None]
    half = d // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference_drafts(head_folder: str, hf_target, token_ids: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after token_ids (target ids), everything recomputed."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(head_folder, "config.json")))
    speculators = "speculators_model_type" in cfg
    lc = cfg["transformer_layer_config"] if speculators else cfg
    w = load_file(os.path.join(head_folder, "model.safetensors"))
    p = "layers.0." if speculators else "midlayer."
    eps, heads, kvh = lc["rms_norm_eps"], lc["num_attention_heads"], lc["num_key_value_heads"]
    hd = lc["hidden_size"] // heads
    n_target = hf_target.config.num_hidden_layers
    aux = (cfg.get("eagle_aux_hidden_state_layer_ids")
           or cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
           or [2, n_target // 2, n_target - 3])
    embed = w.get("embed_tokens.weight", hf_target.get_input_embeddings().weight.detach())
    with torch.no_grad():
        feats = hf_hidden(hf_target, token_ids, tuple(sorted(aux)))[:-1] @ w["fc.weight"].T
    ids, states, drafts = list(token_ids[1:]), [feats[i] for i in range(len(feats))], []
    for _ in range(k):
        x = embed[torch.tensor(ids)]
        s = torch.stack(states)
        normed = _rms(s, w[p + "hidden_norm.weight"], eps)
        residual = normed if cfg.get("norm_before_residual", speculators) else s
        hcat = torch.cat((_rms(x, w[p + "input_layernorm.weight"], eps), normed), -1)
        n = len(ids)
        q = (hcat @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, hd)
        kk = (hcat @ w[p + "self_attn.k_proj.weight"].T).view(n, kvh, hd)
        v = (hcat @ w[p + "self_attn.v_proj.weight"].T).view(n, kvh, hd)
        pos = torch.arange(n)
        q, kk = _rotate(q, pos, lc["rope_theta"]), _rotate(kk, pos, lc["rope_theta"])
        kk, v = kk.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True).transpose(0, 1).reshape(n, -1)
        r = o @ w[p + "self_attn.o_proj.weight"].T + residual
        m = _rms(r, w[p + "post_attention_layernorm.weight"], eps)
        out = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
               ) @ w[p + "mlp.down_proj.weight"].T + r
        best = int((_rms(out[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T).argmax())
        drafts.append(best + int(w["d2t"][best]))
        ids.append(drafts[-1])
        states.append(out[-1])
    return drafts
