"""Train an EAGLE-3 draft head on the CPU from `hsserve extract --eagle3` shards and save it in
SpecForge's layout (config.json + model.safetensors), which the server's `speculative_model` loads.

    python client_examples/eagle3/train.py --shards SHARDS --model TARGET --output HEAD

The head reads, at each position t, the target's layers 2 / L/2 / L-3 there (fused by fc) and the
token at t + 1, and learns the token at t + 2 (in the shards: the target's own greedy output).
Training-time test: the head is also unrolled `--steps` times on its own pre-norm output, as it
runs when it drafts several tokens; step j's query at u sees the first step's keys up to u - j + 1
and each later step's key on its diagonal, which is what the server's cache holds at that point.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn


def load_shards(folder: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """[(token ids [T], the three layers [T, 3 H])] per record, and the layers' indices."""
    with open(os.path.join(folder, "index.json")) as f:
        layers = json.load(f)["args"]["layers"]
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "shard-*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            ids, rows, offsets = (f.get_tensor(k)
                                  for k in ("input_ids", "hidden_states", "offsets"))
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            if b - a >= 3:
                records.append((ids[a:b].long(), rows[a:b].float()))
    return records, layers


def target_weights(folder: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The target's config, its embedding and its lm_head (tied: the embedding)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    found = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for k in ("model.embed_tokens.weight", "lm_head.weight"):
                if k in f.keys():
                    found[k] = f.get_tensor(k).float()
    embed = found["model.embed_tokens.weight"]
    return cfg, embed, found.get("lm_head.weight", embed)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    f = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat((f, f), -1).cos()[:, None], torch.cat((f, f), -1).sin()[:, None]
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1) * sin


class Head(nn.Module):
    def __init__(self, cfg: dict, lm_rows: torch.Tensor):
        super().__init__()
        h, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.kvh = cfg["num_key_value_heads"]
        self.hd, self.eps, self.theta = h // self.heads, cfg["rms_norm_eps"], cfg["rope_theta"]
        inter = cfg["intermediate_size"]
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q = nn.Linear(2 * h, self.heads * self.hd, bias=False)
        self.k = nn.Linear(2 * h, self.kvh * self.hd, bias=False)
        self.v = nn.Linear(2 * h, self.kvh * self.hd, bias=False)
        self.o = nn.Linear(self.heads * self.hd, h, bias=False)
        self.gate, self.up = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h)) for n in
                                       ("input", "hidden", "post", "final")})
        # NOTE: the target's own rows, kept: fewer weights to fit from few prompts
        self.lm_head = nn.Parameter(lm_rows.clone(), requires_grad=False)

    def qkv(self, x: torch.Tensor, state: torch.Tensor, pos: torch.Tensor):
        h = torch.cat((rms(x, self.norms["input"], self.eps),
                       rms(state, self.norms["hidden"], self.eps)), -1)
        n = len(h)
        q = rotate(self.q(h).view(n, self.heads, self.hd), pos, self.theta)
        k = rotate(self.k(h).view(n, self.kvh, self.hd), pos, self.theta)
        return q, k, self.v(h).view(n, self.kvh, self.hd)

    def rest(self, attn: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-norm output, draft logits) after the attention."""
        r = self.o(attn) + state
        m = rms(r, self.norms["post"], self.eps)
        out = self.down(F.silu(self.gate(m)) * self.up(m)) + r
        return out, rms(out, self.norms["final"], self.eps) @ self.lm_head.T


def unrolled_loss(head: Head, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor,
                  labels: torch.Tensor, steps: int) -> torch.Tensor:
    """Cross-entropy of the draft tokens over `steps` unrolled steps (weights 0.8^j)."""
    n = len(ids) - 2
    x, pos = embed[ids[1 : n + 1]], torch.arange(n)
    state, keys, values, total = head.fc(feats[:n]), [], [], 0.0
    rep = head.heads // head.kvh
    for j in range(steps):
        q, k, v = head.qkv(x, state, pos)
        keys.append(k.repeat_interleave(rep, 1))
        values.append(v.repeat_interleave(rep, 1))
        u, p = pos[:, None], pos[None, :]
        masks = [p <= u - j] + [p == u - (j - i) for i in range(1, j + 1)]
        mask = torch.cat(masks, dim=1)
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1), torch.cat(keys).transpose(0, 1), torch.cat(values).transpose(0, 1),
            attn_mask=mask).transpose(0, 1).reshape(n, -1)
        out, logits = head.rest(torch.nan_to_num(att), state)
        want = labels[:n].clone()
        want[:j] = -100  # NOTE: step j at u drafts from the head's output at u - 1
        total = total + 0.8 ** j * F.cross_entropy(logits, want, ignore_index=-100)
        state = torch.cat((state[:1], out[:-1]))  # NOTE: the next step reads u - 1's output
    return total


def draft_vocabulary(records, size: int) -> torch.Tensor:
    """The `size` most frequent tokens the head learns to draft (labels of the shards)."""
    counts = torch.bincount(torch.cat([ids[2:] for ids, _ in records]))
    top = torch.argsort(counts, descending=True)[:size]
    return torch.sort(top[counts[top] > 0]).values


def save_head(head: Head, cfg: dict, vocab: torch.Tensor, layers: list[int], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    h = cfg["hidden_size"]
    p, w = "midlayer.", {}
    w.update({"fc.weight": head.fc.weight, "lm_head.weight": head.lm_head,
              "norm.weight": head.norms["final"], p + "input_layernorm.weight": head.norms["input"],
              p + "hidden_norm.weight": head.norms["hidden"],
              p + "post_attention_layernorm.weight": head.norms["post"],
              p + "self_attn.q_proj.weight": head.q.weight,
              p + "self_attn.k_proj.weight": head.k.weight,
              p + "self_attn.v_proj.weight": head.v.weight,
              p + "self_attn.o_proj.weight": head.o.weight,
              p + "mlp.gate_proj.weight": head.gate.weight,
              p + "mlp.up_proj.weight": head.up.weight,
              p + "mlp.down_proj.weight": head.down.weight})
    w = {k: v.detach().contiguous() for k, v in w.items()}
    w["d2t"] = vocab - torch.arange(len(vocab))
    w["t2d"] = torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, vocab, True)
    save_file(w, os.path.join(out, "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "num_attention_heads": cfg["num_attention_heads"],
              "num_key_value_heads": cfg["num_key_value_heads"],
              "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": 1,
              "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"],
              "max_position_embeddings": cfg["max_position_embeddings"], "hidden_act": "silu",
              "vocab_size": cfg["vocab_size"], "draft_vocab_size": len(vocab),
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
              "torch_dtype": "float32"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def train(shards: str, model: str, output: str, epochs: int = 4, steps: int = 3,
          draft_vocab: int = 4096, lr: float = 3e-3, seed: int = 0, log=print) -> str:
    torch.manual_seed(seed)
    records, layers = load_shards(shards)
    cfg, embed, lm_head = target_weights(model)
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    vocab = draft_vocabulary(records, draft_vocab)
    to_draft = torch.full((cfg["vocab_size"],), -100, dtype=torch.long)
    to_draft[vocab] = torch.arange(len(vocab))
    head = Head(cfg, lm_head[vocab])
    trained = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.0)
    total = epochs * len(records)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=total, pct_start=0.1)
    order, t0 = list(range(len(records))), time.monotonic()
    for epoch in range(epochs):
        random.Random(seed + epoch).shuffle(order)
        seen = 0.0
        for i in order:
            ids, feats = records[i]
            loss = unrolled_loss(head, embed, ids, feats, to_draft[ids[2:]], steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, 1.0)
            opt.step()
            sched.step()
            seen += float(loss)
        log(f"epoch {epoch + 1}/{epochs}: loss {seen / len(order):.3f} "
            f"({time.monotonic() - t0:.0f} s)")
    save_head(head, cfg, vocab, layers, output)
    return output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", required=True, help="hsserve extract --eagle3 --mode full output")
    p.add_argument("--model", required=True, help="the target's folder (config, embeddings)")
    p.add_argument("--output", required=True, help="where the head goes")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="training-time test unroll")
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    train(a.shards, a.model, a.output, a.epochs, a.steps, a.draft_vocab, a.lr)
    print(f"head saved in {a.output}")


if __name__ == "__main__":
    main()
