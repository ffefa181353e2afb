"""A served tensor_parallel_size 2 model streams what one rank and transformers compute.

Issue 27 through the real tritonserver: llm_tp2 (a tiny random Llama, tensor_parallel_size 2,
in an engine process with a rank of its own) streams the tokens and rows of one rank in process
and of transformers."""

from __future__ import annotations

import torch
from oracle import hf_greedy, hf_hidden, max_rel_row_diff
from triton_helpers import stream_once

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

LAYERS = [0, 1, -1]


def test_two_ranks_serve_what_one_computes(triton_server, tiny_model_dir, hf_model):
    folder = tiny_model_dir("llama")
    prompt = [(71 * i) % 30000 + 200 for i in range(23)]
    got = stream_once(triton_server.grpc_url, dict(
        input_ids=prompt, max_tokens=6, temperature=0.0, MODE="full", hidden_layers=LAYERS,
        stream=True), model="llm_tp2")
    assert got.error is None, got.error
    tokens = [int(t) for t in got.cat("output_ids")]
    assert tokens == hf_greedy(hf_model(folder), prompt, 6, 2)
    rows = torch.from_numpy(got.cat("HIDDEN_STATES"))
    ref = hf_hidden(hf_model(folder), prompt + tokens, tuple(LAYERS))
    assert max_rel_row_diff(rows, ref, len(LAYERS)) <= 1e-3
    engine = Engine(EngineConfig(model=folder, device="cpu", num_kv_blocks=64)).start()
    try:
        one = engine.generate(GenerationRequest("one", prompt_ids=prompt, sampling=SamplingParams(
            max_tokens=6, temperature=0.0), hidden_mode=HiddenStatesMode.FULL,
            hidden_layers=tuple(LAYERS)), timeout=120)
    finally:
        engine.shutdown()
    assert one.token_ids == tokens
    assert max_rel_row_diff(rows, one.hidden, len(LAYERS)) <= 1e-4
