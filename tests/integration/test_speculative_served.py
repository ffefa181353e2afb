"""Served with n-gram drafts, the real server streams llm's tokens and rows, and counts drafts.

Issue 44 through the real tritonserver: llm_spec (SmolLM2 with speculative_method ngram) streams
the same tokens, text and MODE=full rows as llm on a copy-heavy prompt, in fewer responses than
tokens, and /metrics counts the drafted and accepted tokens under its own model label."""

from __future__ import annotations

import time

import numpy as np
from triton_helpers import metrics, stream_once

TEXT = ("The committee met on Tuesday to discuss the budget for the new library, which will open "
        "in the spring with a reading room, a cafe and a garden. ")
FIELDS = dict(text_input=f"Repeat this text exactly:\n{TEXT}\nRepeated text:\n", max_tokens=32,
              temperature=0.0, MODE="full", hidden_layers=[0, -1], stream=True)


def test_drafts_give_the_same_tokens_and_rows_and_are_counted(triton_server):
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    before = metrics(url, "llm_spec")
    spec = stream_once(triton_server.grpc_url, FIELDS, model="llm_spec")
    plain = stream_once(triton_server.grpc_url, FIELDS, model="llm")
    assert spec.error is None and plain.error is None, (spec.error, plain.error)
    assert spec.cat("output_ids").tolist() == plain.cat("output_ids").tolist()
    assert spec.cat("text_output") == plain.cat("text_output")
    rows, ref = spec.cat("HIDDEN_STATES"), plain.cat("HIDDEN_STATES")
    assert rows.shape == ref.shape
    assert np.abs(rows - ref).max() <= 1e-3 * np.linalg.norm(ref, axis=-1).max()
    assert len(spec.responses) < 32, "accepted drafts: several tokens a response"
    deadline, after = time.time() + 30, before
    while time.time() < deadline:
        after = metrics(url, "llm_spec")
        if after.get("llm_spec_accepted_tokens_total", 0) > before.get(
                "llm_spec_accepted_tokens_total", 0):
            break
        time.sleep(0.2)
    drafted = after["llm_spec_draft_tokens_total"] - before.get("llm_spec_draft_tokens_total", 0)
    accepted = after["llm_spec_accepted_tokens_total"] - before.get(
        "llm_spec_accepted_tokens_total", 0)
    assert 0 < accepted <= drafted
    assert metrics(url, "llm").get("llm_spec_draft_tokens_total", 0) == 0


def test_an_eagle3_head_serves_the_models_own_tokens_and_rows(triton_server, tiny_model_dir):
    # NOTE: llm_eagle3: the tiny Llama with a random head, loaded from config.pbtxt's parameters
    from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams

    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    before = metrics(url, "llm_eagle3").get("llm_spec_draft_tokens_total", 0)
    fields = dict(input_ids=list(range(100, 140)), max_tokens=24, temperature=0.0,
                  ignore_eos=True, MODE="full", hidden_layers=[0, -1], stream=True)
    got = stream_once(triton_server.grpc_url, fields, model="llm_eagle3")
    assert got.error is None, got.error
    engine = Engine(EngineConfig(model=tiny_model_dir("llama"), device="cpu")).start()
    try:
        want = engine.generate(GenerationRequest(
            "p", prompt_ids=list(range(100, 140)), hidden_mode=HiddenStatesMode.FULL,
            hidden_layers=(0, -1), sampling=SamplingParams(max_tokens=24, temperature=0.0,
                                                            ignore_eos=True)), timeout=60)
    finally:
        engine.shutdown()
    assert got.cat("output_ids").tolist() == want.token_ids
    rows, ref = got.cat("HIDDEN_STATES"), want.hidden.numpy()
    assert rows.shape == ref.shape
    assert np.abs(rows - ref).max() <= 1e-3 * np.linalg.norm(ref, axis=-1).max()
    deadline, drafted = time.time() + 30, before
    while time.time() < deadline and drafted == before:
        drafted = metrics(url, "llm_eagle3").get("llm_spec_draft_tokens_total", 0)
        time.sleep(0.2)
    assert drafted > before
