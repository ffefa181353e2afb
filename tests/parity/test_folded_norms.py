"""Layers with their norms folded into the GEMMs (Decoder.fold_norms) equal transformers'.

The layers with their norms folded into the GEMMs (what CUDA runs, Decoder.fold_norms) against
transformers, on the CPU through the torch references: the norm weights are made non-trivial (a
fresh model's are all ones, which would fold to nothing)."""

from __future__ import annotations

import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from hsserve.models import loader
from oracle import hf_greedy, hf_hidden, max_rel_row_diff


def model_with_norm_weights(source: str, folder: str):
    """The tiny model in `source` with random norm weights, saved to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.3, 1.7)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "qwen3_moe", "mixtral"])
def test_folded_layers_match_transformers(family, tiny_model_dir, tmp_path, monkeypatch):
    hf = model_with_norm_weights(tiny_model_dir(family), str(tmp_path))
    monkeypatch.setattr(loader, "fold_norms_on", lambda device: True)
    engine = Engine(EngineConfig(model=str(tmp_path), device="cpu", block_size=16)).start()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (1, 9, 30, 47)]
    layers = (0, 1, 2, -1)
    try:
        assert engine.executor.model.folded
        streams = [engine.submit(GenerationRequest(
            f"f{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=8, temperature=0.0),
            hidden_mode=HiddenStatesMode.FULL if i % 2 else HiddenStatesMode.LAST,
            hidden_layers=layers)) for i, p in enumerate(prompts)]
        results = [s.result(timeout=300) for s in streams]
    finally:
        engine.shutdown()
    for i, (p, r) in enumerate(zip(prompts, results)):
        assert r.token_ids == hf_greedy(hf, p, 8, 2)
        ref = hf_hidden(hf, p + r.token_ids, layers)
        if i % 2 == 0:  # NOTE: MODE=last: the row of the last token only
            ref = ref[-1:]
        assert max_rel_row_diff(r.hidden, ref, len(layers)) <= 1e-3


@pytest.mark.parametrize("family, folds", [("llama", True), ("qwen2", False), ("qwen3", True),
                                           ("qwen3_moe", True), ("gemma3", False)])
def test_only_layers_without_qkv_bias_or_gemma_norms_fold(family, folds, tiny_model_dir, tmp_path):
    from hsserve.models.loader import load_model

    model_with_norm_weights(tiny_model_dir(family), str(tmp_path))
    model = load_model(str(tmp_path), "bfloat16", torch.device("cpu"))  # NOTE: not packed
    assert model.fold_norms() is folds and model.folded is folds
    w = model.layers[0].attn.qkv.weight.clone()
    assert model.fold_norms() is folds  # NOTE: again: nothing more is multiplied in
    assert torch.equal(model.layers[0].attn.qkv.weight, w)
