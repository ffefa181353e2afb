"""Log-probabilities of sampled tokens, for the requests that ask (SamplingParams.logprobs).

The log-softmax of the model's logits before any sampling transform (temperature, top-k / top-p,
min_tokens' masking), as vLLM returns them by default; the sampled token's value and rank (1 =
the most likely), and the k most likely tokens. Computed on the device right after sampling,
for the rows that ask only, and copied to the host with the step's other results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsserve.engine.transfer import download, upload
from hsserve.kernels.token_logprob import token_logprob
from hsserve.request import SamplingParams, TokenLogprob


@dataclass
class StepLogprobs:
    """Host copies (valid once the step's copies are done) for some of a step's sampling rows."""

    rows: list[int]  # which sampling rows (in the step's order of sampling chunks)
    ks: list[int]  # top alternatives asked by each
    stats: torch.Tensor  # [r, 3] float32: the sampled token's log-probability, rank, logsumexp
    top_ids: torch.Tensor | None  # [r, K] (K: the largest k), None when every k is 0
    top_values: torch.Tensor | None


def step_logprobs(logits: torch.Tensor, samples: torch.Tensor,
                  params: list[SamplingParams]) -> StepLogprobs | None:
    """logits [S, vocab] and samples [S] (on the device) of a step's sampling rows."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    idx = upload(rows, logits.device) if len(rows) < len(params) else None
    x = (logits if idx is None else logits[idx]).float()
    tok = samples[: len(params)] if idx is None else samples[idx]
    # NOTE: one pass, one launch: the log-softmax is never materialized
    stats = token_logprob(x, tok)
    ks = [params[i].logprobs for i in rows]
    top_ids = top_values = None
    if max(ks):
        top = x.topk(max(ks), dim=-1)
        top_ids, top_values = download(top.indices), download(top.values - stats[:, 2:])
    return StepLogprobs(rows, ks, download(stats), top_ids, top_values)


def token_logprobs(found: StepLogprobs | None, sampled: list[bool]) -> list[TokenLogprob | None]:
    """Per chunk of the step (sampled: whether it sampled), its token's entry or None. Called
    once the step's copies are done."""
    out: list[TokenLogprob | None] = [None] * len(sampled)
    if found is None:
        return out
    chunk_of = [i for i, f in enumerate(sampled) if f]
    stats = found.stats.tolist()
    ids = found.top_ids.tolist() if found.top_ids is not None else None
    values = found.top_values.tolist() if found.top_values is not None else None
    for j, (row, k) in enumerate(zip(found.rows, found.ks)):
        top_i = ids[j][:k] if ids is not None else []
        top_v = values[j][:k] if values is not None else []
        out[chunk_of[row]] = TokenLogprob(stats[j][0], int(stats[j][1]), top_i, top_v)
    return out
