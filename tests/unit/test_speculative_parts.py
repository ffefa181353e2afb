"""N-gram proposals, the acceptance rule's output distribution, and speculative config refusals."""

from __future__ import annotations

import pytest
import torch

from hsserve.engine.config import ConfigError, EngineConfig
from hsserve.engine.sampler import sample
from hsserve.engine.speculative import NgramProposer, accepted_length
from hsserve.request import SamplingParams


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(k=3, ngram_min=1, ngram_max=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 10) == (7, 8, 1)  # NOTE: latest of 3
    assert p.propose([5, 1, 2, 6, 4, 2], 10) == (6, 4, 2)  # NOTE: falls back to one token
    assert p.propose([1, 2, 3, 4], 10) == (), "no suffix recurs"
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 2) == (9, 1), "the limit caps the draft"
    assert p.propose([1, 2, 3, 9, 1, 2, 3], 0) == ()
    assert p.propose([4, 4], 5) == (4,), "what follows runs to the sequence's end"
    assert NgramProposer(3, 2, 3).propose([5, 1, 2, 6, 4, 2], 10) == (), "below ngram_min"


def test_accepted_length_stops_at_the_first_disagreement():
    assert accepted_length((4, 5, 6), [4, 5, 6, 7]) == 3
    assert accepted_length((4, 5, 6), [4, 9, 6, 7]) == 1
    assert accepted_length((4,), [3, 1]) == 0
    assert accepted_length((), [3]) == 0


def test_verified_tokens_follow_the_targets_joint_distribution():
    """Two positions over a vocabulary of 4: the first token from p1; the second from p2 given the
    first, whether it came from the verified draft's row (first == draft) or the next step's."""
    torch.manual_seed(0)
    p1 = torch.tensor([0.45, 0.3, 0.15, 0.1])
    p2 = torch.softmax(torch.randn(4, 4) * 1.5, dim=-1)  # NOTE: p2[x1] given the first token
    draft = (1, 2)
    n = 6000
    sp = [SamplingParams(temperature=1.0)] * n
    seeds = list(range(1000, 1000 + n))
    first = sample(p1.log().expand(n, 4).contiguous(), sp, seeds, [0] * n)
    accepted = [accepted_length(draft[:1], [t]) for t in first.tolist()]
    # NOTE: an accepted draft's row gives p2(. | draft[0]); else the next step's gives p2(. | x1)
    context = torch.where(torch.tensor(accepted) == 1, torch.tensor(draft[0]), first)
    second = sample(p2[context].log().contiguous(), sp, seeds, [1] * n)
    counts = torch.zeros(4, 4)
    counts.index_put_((first, second), torch.ones(n), accumulate=True)
    expected = (p1[:, None] * p2) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7, f"chi-square {chi2:.1f} over 15 degrees of freedom (p = 0.001: 37.7)"
    rate = sum(accepted) / n
    assert abs(rate - float(p1[draft[0]])) < 0.03, "a draft is accepted with its probability"


@pytest.mark.parametrize("kw, word", [
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(speculative_method="eagle3", num_speculative_tokens=3), "speculative_model: required"),
    (dict(speculative_method="eagle3", num_speculative_tokens=3, speculative_model="/x"),
     "speculative_model: '/x' is not a folder"),
    (dict(speculative_method="eagle3", speculative_model="/x"), "num_speculative_tokens: 0"),
    (dict(num_speculative_tokens=4), "num_speculative_tokens: set while"),
    (dict(ngram_max=3), "ngram_max: set while"),
    (dict(speculative_method="ngram"), "num_speculative_tokens: 0 must be in 1..32"),
    (dict(speculative_method="ngram", num_speculative_tokens=33), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=4, speculative_model="/x"),
     "speculative_model"),
    (dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=5, ngram_max=3),
     "ngram_min: 5 must be <= ngram_max"),
    (dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=-1), "ngram_min"),
    (dict(speculative_method="ngram", num_speculative_tokens=16, max_num_seqs=8,
          max_num_batched_tokens=16), "max_num_batched_tokens"),
])
def test_bad_speculative_settings_are_refused_naming_the_parameter(kw, word):
    with pytest.raises(ConfigError, match=word):
        EngineConfig(**kw)


def test_speculative_settings_parse_from_config_parameters():
    c = EngineConfig.from_parameters({"speculative_method": "ngram", "num_speculative_tokens": "5",
                                      "ngram_min": "2"})
    assert (c.num_speculative_tokens, c.ngram_range) == (5, (2, 4))
    assert EngineConfig(speculative_method="ngram", num_speculative_tokens=2,
                        ngram_min=6).ngram_range == (6, 6)
