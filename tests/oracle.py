"""transformers as the ground truth: greedy generate and hidden_states of a forward."""

from __future__ import annotations

import torch


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | list[int],
              min_new_tokens: int = 0) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if isinstance(eos, int) else eos[0],
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_hidden(model, token_ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[len(token_ids), hidden * len(layers)]: hidden_states[k] rows, layers concatenated."""
    out = model(torch.tensor([token_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[k][0] for k in layers], dim=-1).float()


def max_rel_row_diff(ours: torch.Tensor, ref: torch.Tensor, num_layers: int = 1) -> float:
    """max over rows and layers of max|diff| / ||ref row of that layer||."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    worst = 0.0
    for o, r in zip(ours.chunk(num_layers, dim=-1), ref.chunk(num_layers, dim=-1)):
        worst = max(worst, float(((o - r).abs().max(dim=-1).values / r.norm(dim=-1)).max()))
    return worst


def min_layer_cosine(ours: torch.Tensor, ref: torch.Tensor, num_layers: int) -> float:
    """min over rows and layers of the cosine between our row of a layer and the reference's."""
    return min(float(torch.nn.functional.cosine_similarity(o.float(), r.float(), dim=-1).min())
               for o, r in zip(ours.chunk(num_layers, -1), ref.chunk(num_layers, -1)))
