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
from hsserve.kernels.topk import split_topk, topk_logprobs
from hsserve.request import SamplingParams, TokenLogprob


@dataclass
class StepLogprobs:
    """Host copies (valid once the step's copies are done) for some of a step's sampling rows."""

    rows: list[int]  # which sampling rows asked (in the step's order of sampling chunks)
    ks: list[int]  # top alternatives asked by each
    at: list[int]  # each asked row's entry in values / ranks
    values: torch.Tensor  # [m] float32: sampled tokens' log-probabilities
    ranks: torch.Tensor | None  # [m] float32; None: every sample the most likely (greedy)
    top: torch.Tensor | None  # packed [len(rows), 2K] (K >= max(ks)), as split_topk reads


def step_logprobs(logits: torch.Tensor, samples: torch.Tensor, params: list[SamplingParams],
                  greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> StepLogprobs | None:
    """logits [S, vocab] and samples [S] (on the device) of a step's sampling rows. greedy:
    when the samples are a decode graph's argmax, its (pinned [2, S]: the argmax's
    log-probability and logsumexp, device [S] logsumexp): nothing left to compute for k = 0."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    idx = upload(rows, logits.device) if len(rows) < len(params) else None
    x = (logits if idx is None else logits[idx]).float()
    if greedy is not None:
        values, ranks, at = greedy[0][0], None, rows
        lse = greedy[1] if idx is None else greedy[1][idx]
    else:
        # NOTE: one pass, one launch: the log-softmax is never materialized
        stats = token_logprob(x, samples[: len(params)] if idx is None else samples[idx])
        host = download(stats)
        values, ranks, at, lse = host[:, 0], host[:, 1], list(range(len(rows))), stats[:, 2]
    ks = [params[i].logprobs for i in rows]
    top = download(topk_logprobs(x, lse, max(ks))) if max(ks) else None
    return StepLogprobs(rows, ks, at, values, ranks, top)


def token_logprobs(found: StepLogprobs | None, num_rows: int) -> list[TokenLogprob | None]:
    """Per sampling row of the step (num_rows of them), its token's entry or None. Called once
    the step's copies are done."""
    out: list[TokenLogprob | None] = [None] * num_rows
    if found is None:
        return out
    values = found.values.tolist()
    ranks = found.ranks.tolist() if found.ranks is not None else None
    ids = top_v = None
    if found.top is not None:
        ids, top_v = (t.tolist() for t in split_topk(found.top))
    width = len(ids[0]) if ids else 0
    for j, (row, k) in enumerate(zip(found.rows, found.ks)):
        e = found.at[j]
        if not k:
            alt_ids, alt_v = [], []
        elif k == width:  # NOTE: most often every row asks the same k: no slicing
            alt_ids, alt_v = ids[j], top_v[j]
        else:
            alt_ids, alt_v = ids[j][:k], top_v[j][:k]
        out[row] = TokenLogprob(values[e], int(ranks[e]) if ranks else 1, alt_ids, alt_v)
    return out


_PROMPT_SLICE = 512  # NOTE: prompt rows a time: a 2k-token prompt's logits over 128k ids is 1 GB


@dataclass
class PromptLogprobs:
    """Host copies (valid once the step's copies are done) for one chunk's prompt positions: the
    entries of prompt tokens first..first+m-1."""

    chunk: int
    first: int
    k: int
    stats: torch.Tensor  # [m, 3]: log-probability, rank, logsumexp
    top: torch.Tensor | None  # packed [m, 2K], as split_topk reads


def prompt_logprobs(logits_of, hidden: torch.Tensor, targets: torch.Tensor, k: int):
    """(stats, top) host copies for rows of `hidden` whose next tokens are `targets`; logits_of:
    the model's logits (a collective under tensor parallelism: every rank calls it alike)."""
    stats, tops = [], []
    for s in range(0, hidden.shape[0], _PROMPT_SLICE):
        x = logits_of(hidden[s : s + _PROMPT_SLICE])
        st = token_logprob(x, targets[s : s + _PROMPT_SLICE])
        stats.append(st)
        if k:
            tops.append(topk_logprobs(x, st[:, 2], k))
    stats = download(torch.cat(stats)) if len(stats) > 1 else download(stats[0])
    top = None
    if tops:
        top = download(torch.cat(tops) if len(tops) > 1 else tops[0])
    return stats, top


def prompt_entries(found: PromptLogprobs) -> list[TokenLogprob]:
    """The chunk's prompt tokens' entries. Called once the step's copies are done."""
    values, ranks = found.stats[:, 0].tolist(), found.stats[:, 1].tolist()
    if found.top is None:
        return [TokenLogprob(v, int(r), [], []) for v, r in zip(values, ranks)]
    ids, top_v = (t[:, : found.k].tolist() for t in split_topk(found.top))
    return [TokenLogprob(v, int(r), i, t) for v, r, i, t in zip(values, ranks, ids, top_v)]
