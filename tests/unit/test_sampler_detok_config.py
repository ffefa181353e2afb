"""Seeded sampler noise and filters, UTF-8-safe detokenizing, stop matching, config parsing.

Sampler noise, incremental detokenizer, stop matcher and config parsing."""

from __future__ import annotations

import pytest
import torch

from hsserve.engine.config import ConfigError, EngineConfig
from hsserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher, text_decoder
from hsserve.request import HiddenStatesMode, SamplingParams
from hsserve.engine.sampler import sample, uniform_noise
from hsserve.triton.config import AdapterConfig, split_parameters


def test_noise_depends_only_on_seed_and_step():
    a = uniform_noise(torch.tensor([1, 2, 1]), torch.tensor([0, 0, 5]), 1000)
    b = uniform_noise(torch.tensor([1]), torch.tensor([0]), 1000)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert 0.0 < float(a.min()) and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.02


def test_noise_stays_below_one_where_the_hash_is_largest():
    """A hash of 24 one-bits once gave exactly 1.0 (float32 rounding): an infinite Gumbel that
    picked its token whatever the logits, even a masked (-inf) one."""
    from hsserve.engine.sampler import as_int64

    u = uniform_noise(torch.tensor([as_int64(16294208416658607535)]), torch.tensor([7]), 49152)
    assert float(u.max()) < 1.0 and torch.isfinite(-torch.log(-torch.log(u))).all()


def test_sampling_distribution_follows_softmax():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.zeros(3)
    p = SamplingParams(temperature=1.0)
    for step in range(3000):
        counts[sample(logits.clone(), [p], [11], [step])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_top_k_and_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    steps = list(range(400))
    k2 = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 400, [1] * 400, steps)
    assert set(k2.tolist()) == {0, 1}
    p07 = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 400, [1] * 400, steps)
    assert set(p07.tolist()) == {0, 1}  # 0.5 < 0.7, then 0.8 >= 0.7: the third is dropped
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 400, [1] * 400, steps)
    assert set(greedy.tolist()) == {0}


class ByteTokenizer:
    """Each id is one UTF-8 byte (ids >= 256 are special and skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_detokenizer_never_splits_a_character():
    text = "añ€😀!"
    data = list(text.encode())
    d = IncrementalDetokenizer(ByteTokenizer(), [ord("x")])
    pieces = [d.add(b) for b in data]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[data.index(0xF0) : data.index(0xF0) + 3] == ["", "", ""]


def test_detokenizer_flush_returns_incomplete_tail():
    d = IncrementalDetokenizer(ByteTokenizer(), [])
    assert d.add(0xE2) == "" and d.add(0x82) == ""
    assert d.flush() == "\ufffd"


def test_stop_matcher_holds_back_possible_prefix():
    m = StopMatcher(("STOP",))
    assert not m.feed("abc ST")
    assert m.release(len(m.text), final=False) == "abc"  # "ST" might start "STOP"
    assert m.feed("OP more")
    assert m.release(len(m.text), final=True) == " "
    assert m.text == "abc "


def test_config_from_parameters():
    cfg = EngineConfig.from_parameters({
        "dtype": "bfloat16", "hidden_states_ceiling": "last", "hidden_layers_captured": "0, 5,-1",
        "max_num_seqs": "8", "enable_prefix_caching": "false", "kv_cache_memory_fraction": "0.5",
    })
    assert cfg.dtype == "bfloat16" and cfg.hidden_states_ceiling == HiddenStatesMode.LAST
    assert cfg.hidden_layers_captured == (0, 5, -1) and cfg.max_num_seqs == 8
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_memory_fraction == 0.5
    assert EngineConfig.from_parameters({"hidden_layers_captured": "all"}).hidden_layers_captured is None
    assert EngineConfig.from_parameters({"async_scheduling": "off"}).async_scheduling == "off"
    adapter, engine = split_parameters({"engine_process": "false", "max_num_seqs": "4"}, "bfloat16")
    assert adapter.engine_process is False and AdapterConfig().engine_process is True
    assert engine.max_num_seqs == 4 and engine.hidden_dtype == "bfloat16"
    assert EngineConfig.from_parameters({"prefill_wait_ms": "7.5"}).prefill_wait_ms == 7.5
    for bad, word in [({"dtype": "int8"}, "dtype"), ({"max_num_seqs": "x"}, "max_num_seqs"),
                      ({"nope": "1"}, "unknown parameter"), ({"enable_cuda_graph": "maybe"}, "enable_cuda_graph"),
                      ({"hidden_states_ceiling": "most"}, "hidden_states_ceiling"),
                      ({"async_scheduling": "yes"}, "async_scheduling"),
                      ({"prefill_wait_ms": "-1"}, "prefill_wait_ms")]:
        with pytest.raises((ConfigError, ValueError), match=word):
            EngineConfig.from_parameters(bad)
    for bad, word in [({"engine_process": "sometimes"}, "engine_process"),
                      ({"drain_timeout_s": "-1"}, "drain_timeout_s"), ({"nope": "1"}, "unknown"),
                      ({"default_max_tokens": "5000"}, "default_max_tokens"),
                      ({"stream_interval": "0"}, "stream_interval")]:
        with pytest.raises(ConfigError, match=word):
            split_parameters(bad)


def test_text_decoder_equals_tokenizer_decode(smollm_dir):
    """The fast path (the tokenizers backend's decode) gives exactly tokenizer.decode's text,
    special tokens skipped, pieces of multi-byte characters included."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_dir)
    decode = text_decoder(tok)
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, tok.vocab_size, (n,), generator=g).tolist() for n in (1, 2, 7, 40)]
    samples += [[0, 1, 2] + tok.encode("héllo wörld 🙂 日本"), tok.encode("🙂")[:1]]
    want = [tok.decode(ids, skip_special_tokens=True) for ids in samples]
    tok.decode = None  # NOTE: the fast path must not go through transformers' wrapper
    assert [decode(ids) for ids in samples] == want
    del tok.decode

    class Custom(type(tok)):
        def decode(self, ids, **kw):
            return "custom"

    tok.__class__ = Custom
    assert text_decoder(tok)([1, 2]) == "custom", "a tokenizer that overrides decode is asked"
