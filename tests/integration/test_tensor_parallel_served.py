"""Issue 27 through the real tritonserver: llm_tp2 (the default model, tensor_parallel_size 2, in
an engine process with a rank of its own) streams the tokens and rows of llm (one rank) and of
transformers."""

from __future__ import annotations

import torch
from oracle import hf_greedy, hf_hidden, max_rel_row_diff
from triton_helpers import stream_once

LAYERS = [0, 15, -1]


def test_two_ranks_serve_what_one_serves(triton_server, smollm_dir, hf_model):
    prompt = [(71 * i) % 30000 + 200 for i in range(23)]
    inputs = dict(input_ids=prompt, max_tokens=6, temperature=0.0, MODE="full",
                  hidden_layers=LAYERS, stream=True)
    got = {m: stream_once(triton_server.grpc_url, inputs, model=m) for m in ("llm", "llm_tp2")}
    for m, g in got.items():
        assert g.error is None, (m, g.error)
    tokens = [int(t) for t in got["llm_tp2"].cat("output_ids")]
    assert tokens == [int(t) for t in got["llm"].cat("output_ids")]
    assert tokens == hf_greedy(hf_model(smollm_dir), prompt, 6, 2)
    rows = torch.from_numpy(got["llm_tp2"].cat("HIDDEN_STATES"))
    one = torch.from_numpy(got["llm"].cat("HIDDEN_STATES"))
    assert max_rel_row_diff(rows, one, len(LAYERS)) <= 1e-4
    ref = hf_hidden(hf_model(smollm_dir), prompt + tokens, tuple(LAYERS))
    assert max_rel_row_diff(rows, ref, len(LAYERS)) <= 1e-3
