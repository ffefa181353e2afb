"""EAGLE-3 draft head: one decoder layer over the target's low / middle / high layers.

Two checkpoint layouts load: SpecForge's and the EAGLE authors' `LlamaForCausalLMEagle3` (a
Llama config with `draft_vocab_size`; weights `midlayer.*`) and vLLM speculators'
(`speculators_model_type: eagle3`, the layer's Llama config under `transformer_layer_config`;
weights `layers.0.*`). Weights:
fc [H, 3 H_target] fusing the three target layers, the layer (q / k / v read the normed token
embedding and the normed fused state side by side: 2 H wide), the final norm, lm_head over the
draft vocabulary, d2t (draft id + d2t[id] = target id); embed_tokens when the head has its own,
else it reads the target's.

Draft position t reads the fused target state at t and the token at t + 1, and predicts the token
at t + 2; a following draft step reads the previous step's pre-norm output in place of the fused
state (what the head was trained on: its own output fed back).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from hsserve.models.decoder import MLP, Attention, RMSNorm
from hsserve.models.linear import Linear, pack_for_cpu
from hsserve.models.rope import inverse_frequencies, rotary_for
from hsserve.models.spec import ModelSpec

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


@dataclass(frozen=True)
class Eagle3Spec:
    layer: ModelSpec  # the draft layer's shape (one Llama layer)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target's hidden_states indices fc reads, low to high
    norm_before_residual: bool  # the fused state is normed before it joins the residual
    prefix: str  # the layer's weight names: "midlayer." or "layers.0."


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high: hidden_states 2, L/2 and L-3 (vLLM's and SpecForge's)."""
    return (2, num_layers // 2, num_layers - 3)


def read_spec(folder: str, target: ModelSpec) -> Eagle3Spec:
    """The head's shape from its config.json, checked against the target's; ValueError naming
    the field that does not fit."""
    path = os.path.join(folder, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"speculative_model: {folder!r} is not a folder with config.json")
    with open(path) as f:
        cfg = json.load(f)
    speculators = cfg.get("speculators_model_type")
    if speculators is not None and speculators != "eagle3":
        raise ValueError(f"speculative_model: speculators_model_type {speculators!r}; "
                         "allowed: eagle3")
    layer_cfg = dict(cfg.get("transformer_layer_config") or cfg) if speculators else dict(cfg)
    arch = (cfg.get("architectures") or ["?"])[0]
    if not speculators and arch not in ARCHITECTURES:
        raise ValueError(f"speculative_model: architecture {arch!r}; allowed: "
                         f"{', '.join(ARCHITECTURES)} or a speculators eagle3 config")
    layer_cfg["architectures"] = ["LlamaForCausalLM"]
    layer_cfg.setdefault("vocab_size", target.vocab_size)
    layer = ModelSpec.from_hf_dict(layer_cfg)
    eagle = cfg.get("eagle_config") or {}
    key = "eagle_aux_hidden_state_layer_ids"
    aux = cfg.get(key) or eagle.get(key) or default_aux_layers(target.num_layers)
    spec = Eagle3Spec(
        layer=layer,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(cfg.get("target_hidden_size") or target.hidden_size),
        aux_layers=tuple(sorted(int(k) for k in aux)),
        norm_before_residual=bool(cfg.get("norm_before_residual", speculators is not None)),
        prefix="layers.0." if speculators else "midlayer.",
    )
    _check_fits(spec, target)
    return spec


def _check_fits(spec: Eagle3Spec, target: ModelSpec) -> None:
    layer = spec.layer
    if layer.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_model: vocab_size {layer.vocab_size} differs from the "
                         f"target's {target.vocab_size}")
    if spec.target_hidden_size != target.hidden_size:
        raise ValueError(f"speculative_model: target_hidden_size {spec.target_hidden_size} differs"
                         f" from the target's hidden_size {target.hidden_size}")
    aux = spec.aux_layers
    if len(set(aux)) != 3 or not all(0 <= k <= target.num_layers for k in aux):
        raise ValueError(f"speculative_model: eagle_aux_hidden_state_layer_ids {list(aux)}: "
                         f"three different layers in 0..{target.num_layers} expected")
    # NOTE: the head's K/V lives in the target's block layout (same blocks, same tables)
    for name, ours, theirs in (("num_key_value_heads", layer.num_kv_heads, target.num_kv_heads),
                               ("head_dim", layer.head_dim, target.head_dim),
                               ("num_attention_heads", layer.num_heads, target.num_heads)):
        if ours != theirs:
            raise ValueError(f"speculative_model: {name} {ours} differs from the target's "
                             f"{theirs} (the head's K/V shares the target's cache layout)")
    if not 0 < spec.draft_vocab_size <= target.vocab_size:
        raise ValueError(f"speculative_model: draft_vocab_size {spec.draft_vocab_size} must be "
                         f"in 1..{target.vocab_size}")


class Eagle3Head(nn.Module):
    def __init__(self, spec: Eagle3Spec, target_embed: torch.Tensor):
        super().__init__()
        s = spec.layer
        self.spec, h = spec, s.hidden_size
        self.fc = Linear(3 * spec.target_hidden_size, h)
        self.embed = target_embed  # NOTE: replaced when the checkpoint has its own
        self.input_norm = RMSNorm(h, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, s.rms_norm_eps)
        self.attn = Attention(s)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.attn.qkv = Linear(2 * h, q_size + 2 * kv_size, bias=s.qkv_bias)
        self.post_attn_norm = RMSNorm(h, s.rms_norm_eps)
        self.mlp = MLP(s)
        self.norm = RMSNorm(h, s.rms_norm_eps)
        self.lm_head = Linear(h, spec.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", inverse_frequencies(s.head_dim, s.rope), persistent=False)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's three captured layers [rows, 3, H_target] -> the fused state [rows, H]."""
        return self.fc(aux.reshape(len(aux), -1))

    def forward(self, input_ids, positions, state, batch, kv) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft position per row: (the pre-norm output, fed to the next draft step; the
        draft's greedy token as a target id)."""
        x = torch.nn.functional.embedding(input_ids, self.embed)
        rope = rotary_for(positions, self.inv_freq, x.dtype, fused=False)
        residual = state
        if self.spec.norm_before_residual:
            state = residual = self.hidden_norm(state)
        else:
            state = self.hidden_norm(state)
        h = torch.cat((self.input_norm(x), state), dim=-1)
        h = self.attn(h, rope, batch, kv)
        h, residual = self.post_attn_norm(h, residual)
        out = self.mlp(h) + residual
        logits = self.lm_head(self.norm(out))
        best = logits.argmax(dim=-1)
        return out, best + self.d2t[best]


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    if not files and os.path.exists(os.path.join(folder, "pytorch_model.bin")):
        out = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                         weights_only=True)
    if not out:
        raise ValueError(f"speculative_model: no *.safetensors or pytorch_model.bin in {folder}")
    return out


def load_head(folder: str, target_spec: ModelSpec, target_embed: torch.Tensor) -> Eagle3Head:
    """The head in the target's dtype and device, its weights read from the folder."""
    spec = read_spec(folder, target_spec)
    t = {k.removeprefix("model."): v for k, v in _tensors(folder).items()}
    p = spec.prefix
    names = {
        "fc.weight": ["fc.weight"], "norm.weight": ["norm.weight"],
        "lm_head.weight": ["lm_head.weight"],
        "input_norm.weight": [p + "input_layernorm.weight"],
        "hidden_norm.weight": [p + "hidden_norm.weight"],
        "post_attn_norm.weight": [p + "post_attention_layernorm.weight"],
        "attn.qkv.weight": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
        "attn.o_proj.weight": [p + "self_attn.o_proj.weight"],
        "mlp.gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.down.weight": [p + "mlp.down_proj.weight"],
    }
    if spec.layer.qkv_bias:
        names["attn.qkv.bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    missing = sorted(n for parts in names.values() for n in parts if n not in t)
    if missing:
        raise ValueError(f"speculative_model: the checkpoint in {folder} lacks {missing}")
    dtype, device = target_embed.dtype, target_embed.device
    head = Eagle3Head(spec, target_embed)
    params = dict(head.named_parameters())
    with torch.no_grad():
        for ours, parts in names.items():
            params[ours].data = torch.cat([t[n] for n in parts]).to(device=device, dtype=dtype)
        if "embed_tokens.weight" in t:
            head.embed = nn.Parameter(t["embed_tokens.weight"].to(device=device, dtype=dtype),
                                      requires_grad=False)
        d2t = t.get("d2t", head.d2t)
        if d2t.shape != (spec.draft_vocab_size,):
            raise ValueError(f"speculative_model: d2t has {d2t.numel()} entries for "
                             f"draft_vocab_size {spec.draft_vocab_size}")
        head.d2t = d2t.to(device=device, dtype=torch.long)
    head.inv_freq = head.inv_freq.to(device)  # NOTE: float32, as the target's
    pack_for_cpu(head)
    return head.eval()
