"""A bounded soak on the real server: every valid request served, every bad one refused, no leak.

Issue 7 acceptance 1: a bounded soak against the real server (bench/soak.py's run_soak):
~1,000 requests, random MODEs / lengths / streaming, 20% cancelled mid-flight, 5% malformed."""

from __future__ import annotations

import os
import sys

import numpy as np

from hsserve import GenerationRequest, HiddenStatesMode, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from soak import run_soak  # noqa: E402


def test_soak(triton_server, smollm_engine):
    out = run_soak(triton_server.grpc_url, f"http://127.0.0.1:{triton_server.ports.metrics}/metrics",
                   os.getpgid(triton_server.process.pid), num=1000, seed=1)
    req, outcomes = out["requests"], out["outcomes"]
    assert sum(req.values()) == 1000 and req["cancelled"] > 150 and req["malformed"] > 30
    assert outcomes.get("valid_failed", 0) == 0, outcomes
    assert outcomes.get("malformed_unclear", 0) == 0, outcomes
    assert outcomes["valid_ok"] == req["valid"]
    print("stream retries", out["stream_retries"], out["stream_errors"])
    assert out["kv_blocks_in_use_after"] == 0 and out["requests_running_after"] == 0
    grown = out["rss"]["after_mb"] - out["rss"]["after_warmup_mb"]
    assert grown < 250, out["rss"]
    # a sample of the valid ones equals the engine's own answer
    checked = 0
    for (kind, fields, _, _), res in zip(out["jobs"], out["results"]):
        if kind != "valid" or fields["max_tokens"] == 0 or checked >= 12:
            continue
        mode = HiddenStatesMode.parse(fields["MODE"])
        ref = smollm_engine.generate(GenerationRequest(
            f"soak-ref-{checked}", prompt_ids=fields["input_ids"],
            sampling=SamplingParams(max_tokens=fields["max_tokens"], temperature=fields["temperature"],
                                    seed=fields["seed"], ignore_eos=True),
            hidden_mode=mode, hidden_layers=(-1,) if mode else None), timeout=120)
        assert res["ids"] == ref.token_ids
        if mode != HiddenStatesMode.NONE:
            np.testing.assert_allclose(np.concatenate(res["rows"]), ref.hidden.numpy(), atol=1e-3)
        checked += 1
    assert checked == 12
