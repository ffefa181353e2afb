"""Each new family, served by the real tritonserver, streams transformers' tokens and rows.

Issue 29 through the real tritonserver: each new family (tiny random Phi-3, Mixtral, Qwen3-MoE,
served as llm_<family> beside llm) streams tokens and MODE=full rows equal to transformers'."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES
from oracle import hf_greedy, hf_hidden, max_rel_row_diff
from triton_helpers import stream_once

LAYERS = [0, 1, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_served_family_equals_transformers(family, triton_server, tiny_model_dir, hf_model):
    hf = hf_model(tiny_model_dir(family))
    prompt = [(53 * i) % 40000 + 100 for i in range(19)]
    got = stream_once(triton_server.grpc_url, dict(
        input_ids=prompt, max_tokens=5, temperature=0.0, MODE="full",
        hidden_layers=LAYERS, stream=True), model=f"llm_{family}")
    assert got.error is None, got.error
    tokens = [int(t) for t in got.cat("output_ids")]
    assert tokens == hf_greedy(hf, prompt, 5, 2)
    rows = torch.from_numpy(got.cat("HIDDEN_STATES"))
    ref = hf_hidden(hf, prompt + tokens, tuple(LAYERS))  # NOTE: full: a row for every token
    assert rows.shape == ref.shape
    assert max_rel_row_diff(rows, ref, len(LAYERS)) <= 1e-3
