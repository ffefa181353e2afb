"""Speculative decoding: who proposes draft tokens (prompt lookup; an EAGLE-3 head, whose drafts
engine/drafter.py makes), and how many of them the target accepts.

A decoding sequence's chunk carries k proposed tokens after its last (Chunk.draft); the target
computes all k + 1 positions in one forward and samples its own token at each with the request's
seeded sampler, at that token's output index. Drafts are accepted while they equal the target's
token; the first disagreement is replaced by the target's. For a proposer that puts all its
probability on one token (n-gram lookup) this is the standard rejection rule (accept with
probability p(d), else sample p without d): the emitted tokens are the very tokens decoding
without speculation gives, greedy or seeded (the EAGLE-3 head drafts greedily: a point mass
too). Rejected positions' K/V are overwritten later and their rows never leave the ledger
(hidden_rows.record keeps accepted positions only).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hsserve.engine.sequence import Sequence


def accepted_length(draft: tuple[int, ...], targets: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    m = 0
    for d, t in zip(draft, targets):
        if d != t:
            break
        m += 1
    return m


class NgramProposer:
    """Prompt lookup: the longest suffix of the sequence (ngram_max down to ngram_min tokens)
    that occurred before; the tokens that followed its latest earlier occurrence are the draft."""

    lookahead = 0  # NOTE: KV slots a sequence needs past its draft's (Eagle3Proposer's)

    def __init__(self, k: int, ngram_min: int, ngram_max: int):
        self.k, self.ngram_min, self.ngram_max = k, ngram_min, ngram_max

    def propose_for(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        return self.propose(seq.token_ids, limit)

    def propose(self, token_ids: list[int], limit: int) -> tuple[int, ...]:
        """Up to min(k, limit) tokens to follow token_ids; () when no suffix recurs."""
        k = min(self.k, limit)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.ngram_min:
            return ()
        ids = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            # NOTE: windows that end before the suffix itself starts being the suffix
            windows = sliding_window_view(ids[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == ids[n_tokens - n :]).all(axis=1))
            if hits.size:
                after = int(hits[-1]) + n  # NOTE: the latest occurrence
                return tuple(token_ids[after : after + k])
        return ()


class Eagle3Proposer:
    """The EAGLE-3 head's drafts, made on the device after the previous step (engine/drafter.py)
    and kept on the sequence; a draft that does not follow the sequence's tokens is none."""

    def __init__(self, k: int):
        self.k = k
        # NOTE: the head writes its K/V for its own drafts past the verified positions
        self.lookahead = k

    def propose_for(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        if seq.proposal is None or seq.proposal[0] != seq.num_tokens or limit <= 0:
            return ()
        return seq.proposal[1][:limit]
