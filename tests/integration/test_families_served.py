"""Each new family and an FP8 checkpoint, served by the real tritonserver, give transformers' rows.

Issue 29 through the real tritonserver: each new family (tiny random Phi-3, Mixtral, Qwen3-MoE,
served as llm_<family> beside llm) streams tokens and MODE=full rows equal to transformers'.
Issue 46: llm_fp8 (a compressed-tensors FP8 Llama) streams MODE=full rows and answers MODE=last
equal to transformers loading the same checkpoint."""

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


def test_a_served_fp8_checkpoint_equals_transformers(triton_server, fp8_served_dir, hf_model):
    hf = hf_model(fp8_served_dir)
    prompt = [(31 * i) % 40000 + 200 for i in range(23)]
    got = stream_once(triton_server.grpc_url, dict(
        input_ids=prompt, max_tokens=6, temperature=0.0, MODE="full",
        hidden_layers=LAYERS, stream=True), model="llm_fp8")
    assert got.error is None, got.error
    tokens = [int(t) for t in got.cat("output_ids")]
    assert tokens == hf_greedy(hf, prompt, 6, 2)
    ref = hf_hidden(hf, prompt + tokens, tuple(LAYERS))
    rows = torch.from_numpy(got.cat("HIDDEN_STATES"))
    assert rows.shape == ref.shape
    assert max_rel_row_diff(rows, ref, len(LAYERS)) <= 1e-3
    last = stream_once(triton_server.grpc_url, dict(
        input_ids=prompt, max_tokens=6, temperature=0.0, MODE="last", hidden_layers=LAYERS,
        stream=False), model="llm_fp8")
    assert last.error is None, last.error
    assert [int(t) for t in last.cat("output_ids")] == tokens
    one = torch.from_numpy(last.cat("HIDDEN_STATES")).reshape(1, -1)
    assert max_rel_row_diff(one, ref[-1:], len(LAYERS)) <= 1e-3
