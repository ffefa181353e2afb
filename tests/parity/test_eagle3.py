"""EAGLE-3 heads (issue 44): both layouts load, drafts equal a torch head's, outputs stay exact.

Random heads on the tiny Llama: every proposal equals the reference head recomputed over the whole
sequence (tests/eagle3_heads.py); greedy tokens and MODE full rows equal the engine without
speculation and transformers; heads that do not fit the target are refused naming the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from eagle3_heads import reference_drafts, write_head
from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from hsserve.engine.config import ConfigError
import hsserve.engine.drafter as drafter
from oracle import hf_hidden, max_rel_row_diff


def eagle(folder: str, head: str, k: int = 3, **kw) -> Engine:
    return Engine(EngineConfig(model=folder, device="cpu", speculative_method="eagle3",
                               num_speculative_tokens=k, speculative_model=head, **kw)).start()


@pytest.mark.parametrize("layout, own_embed", [("specforge", False), ("speculators", True)])
def test_drafts_equal_the_reference_head_and_outputs_equal_plain_decoding(
        tiny_model_dir, tmp_path, hf_model, monkeypatch, layout, own_embed):
    folder = tiny_model_dir("llama")
    head = write_head(str(tmp_path / "head"), folder, layout, seed=5, own_embed=own_embed,
                      draft_vocab=list(range(0, 1024, 2)))
    seen = []
    original = drafter.Eagle3Drafter.draft

    def draft(self, step, tokens):
        original(self, step, tokens)
        seen.extend(c.seq.proposal for c in step.chunks if c.seq.proposal is not None)

    monkeypatch.setattr(drafter.Eagle3Drafter, "draft", draft)
    ours, plain = eagle(folder, head), Engine(EngineConfig(model=folder, device="cpu")).start()
    try:
        prompt = list(range(100, 131))
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        got, want = (e.generate(GenerationRequest(f"r{i}", prompt_ids=prompt, sampling=sp,
                                                  hidden_mode=HiddenStatesMode.FULL,
                                                  hidden_layers=(0, 2, -1)), timeout=120)
                     for i, e in enumerate((ours, plain)))
        assert ours.stats.draft_tokens > 0
    finally:
        ours.shutdown()
        plain.shutdown()
    assert got.token_ids == want.token_ids
    hf = hf_model(folder)
    ref = hf_hidden(hf, prompt + got.token_ids, (0, 2, -1))
    assert max_rel_row_diff(got.hidden, ref, 3) <= 1e-3
    full = prompt + got.token_ids
    assert len(seen) >= 20
    for n, drafts in seen:
        assert list(drafts) == reference_drafts(head, hf, full[:n], len(drafts)), n


def _edit_config(head: str, **changes) -> None:
    path = os.path.join(head, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("change, word", [
    (dict(vocab_size=1000), "vocab_size 1000 differs"),
    (dict(num_key_value_heads=4), "num_key_value_heads 4 differs"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}),
     "eagle_aux_hidden_state_layer_ids"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), "0..3"),
    (dict(architectures=["MedusaModel"]), "architecture 'MedusaModel'"),
    (dict(draft_vocab_size=60000), "draft_vocab_size"),
    (None, "lacks"),
])
def test_a_head_that_does_not_fit_is_refused_naming_the_field(tiny_model_dir, tmp_path, change,
                                                               word):
    folder = tiny_model_dir("llama")
    head = write_head(str(tmp_path / "head"), folder)
    if change is None:  # NOTE: a weight missing
        from safetensors.torch import load_file, save_file

        w = load_file(os.path.join(head, "model.safetensors"))
        del w["midlayer.mlp.down_proj.weight"]
        save_file(w, os.path.join(head, "model.safetensors"))
    else:
        _edit_config(head, **change)
    with pytest.raises(ConfigError, match=f"speculative_model: .*{word}"):
        eagle(folder, head)


def test_eagle3_with_tensor_parallel_or_ngram_settings_is_refused(tmp_path, tiny_model_dir):
    head = write_head(str(tmp_path / "h"), tiny_model_dir("llama"))
    base = dict(speculative_method="eagle3", num_speculative_tokens=2, speculative_model=head)
    with pytest.raises(ConfigError, match="tensor_parallel_size 1 only"):
        EngineConfig(**base, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="ngram_max: prompt lookup's"):
        EngineConfig(**base, ngram_max=3)
    shutil.rmtree(head)
