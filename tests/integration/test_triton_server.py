"""The real tritonserver's outputs equal the in-process engine's: streams, cancels, errors.

Issue 3 acceptance against the real tritonserver: exact outputs, concurrency, cancellation,
errors. Reference: the same requests through the in-process engine, alone."""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import torch

from hsserve import GenerationRequest, HiddenStatesMode, SamplingParams
from triton_helpers import GrpcStream, http_generate, metrics, stream_once, unary_grpc, unary_http

PROMPT = "The three primary colours are"


def engine_reference(engine, fields: dict):
    mode = HiddenStatesMode.parse(fields.get("MODE", "none"))
    req = GenerationRequest(
        f"ref-{time.monotonic_ns()}",
        prompt=fields.get("text_input"),
        prompt_ids=fields.get("input_ids"),
        sampling=SamplingParams(max_tokens=fields.get("max_tokens", 16),
                                temperature=fields.get("temperature", 1.0),
                                seed=fields.get("seed"), ignore_eos=fields.get("ignore_eos", False)),
        hidden_mode=mode,
        hidden_layers=tuple(fields["hidden_layers"]) if "hidden_layers" in fields else None,
    )
    return smollm_result(engine.generate(req, timeout=300))


def smollm_result(res):
    return {
        "ids": list(res.token_ids),
        "text": res.text,
        "hidden": None if res.hidden is None else res.hidden.numpy(),
        "finish": res.finish_reason.value,
    }


CASES = [
    dict(text_input=PROMPT, max_tokens=12, temperature=0.0),
    dict(text_input=PROMPT, max_tokens=10, temperature=0.0, MODE="last"),
    dict(text_input=PROMPT, max_tokens=8, temperature=0.0, MODE="full", hidden_layers=[0, 7, -1]),
    dict(text_input=PROMPT, max_tokens=0, MODE="full", hidden_layers=[-2]),
    dict(text_input=PROMPT, max_tokens=9, temperature=0.8, seed=11, MODE="last",
         hidden_layers=[3, -1]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.get('MODE', 'none')}-{c['max_tokens']}")
def test_all_paths_equal_engine(triton_server, smollm_engine, case):
    ref = engine_reference(smollm_engine, case)
    url = triton_server.grpc_url
    outs = {
        "grpc-stream": stream_once(url, {**case, "stream": True}),
        "grpc-one-response": stream_once(url, {**case, "stream": False}),
    }
    for name, got in outs.items():
        assert got.error is None, (name, got.error)
        assert list(got.cat("output_ids")) == ref["ids"], name
        assert got.cat("text_output") == ref["text"], name
        assert got.final("finish_reason")[0].decode() == ref["finish"], name
        assert int(got.final("num_output_tokens")[0]) == len(ref["ids"])
        hidden = got.cat("HIDDEN_STATES")
        if ref["hidden"] is None:
            assert hidden is None
        else:
            np.testing.assert_array_equal(hidden, ref["hidden"], err_msg=name)
    assert len(outs["grpc-one-response"].responses) == 1
    for unary in (unary_http(triton_server.http_url, case), unary_grpc(url, case)):
        assert list(unary["output_ids"]) == ref["ids"]
        assert unary["text_output"][0].decode() == ref["text"]
        if ref["hidden"] is None:
            assert unary["HIDDEN_STATES"] is None
        else:
            np.testing.assert_array_equal(unary["HIDDEN_STATES"], ref["hidden"])


def test_streaming_full_mode_rows_follow_tokens(triton_server):
    got = stream_once(triton_server.grpc_url, dict(text_input=PROMPT, max_tokens=6, temperature=0.0,
                                                   ignore_eos=True, MODE="full", stream=True))
    assert got.error is None and len(got.responses) >= 2
    prompt_len = int(got.final("num_input_tokens")[0])
    first = got.responses[0]
    assert first["HIDDEN_STATES"].shape == (prompt_len + len(first["output_ids"]), 576)
    for r in got.responses[1:]:
        assert r["HIDDEN_STATES"].shape[0] == len(r["output_ids"])


def test_stream_interval_gives_the_same_tokens_text_and_rows_in_fewer_responses(triton_server):
    fields = dict(text_input=PROMPT, max_tokens=11, temperature=0.0, ignore_eos=True, MODE="full",
                  stream=True)
    one = stream_once(triton_server.grpc_url, fields)
    four = stream_once(triton_server.grpc_url, fields, parameters={"stream_interval": 4})
    js = stream_once(triton_server.grpc_url, {**fields,
                                               "sampling_parameters": '{"stream_interval": "4"}'})
    assert one.error is None and four.error is None and js.error is None
    ids = lambda got: [int(t) for r in got.responses for t in r["output_ids"]]  # noqa: E731
    text = lambda got: "".join(r["text_output"][0].decode() for r in got.responses)  # noqa: E731
    rows = lambda got: np.concatenate([r["HIDDEN_STATES"] for r in got.responses])  # noqa: E731
    assert len(one.responses) == 11
    for got in (four, js):
        assert [len(r["output_ids"]) for r in got.responses] == [1, 4, 4, 2]
        assert ids(got) == ids(one) and text(got) == text(one)
        np.testing.assert_array_equal(rows(got), rows(one))
    bad = stream_once(triton_server.grpc_url, fields, parameters={"stream_interval": 0})
    assert bad.error is not None and "stream_interval" in str(bad.error)


def test_a_stream_naming_its_outputs_gets_those_and_the_same_tokens(triton_server):
    fields = dict(text_input=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, MODE="last",
                  stream=True)
    every = stream_once(triton_server.grpc_url, fields)
    some = stream_once(triton_server.grpc_url, fields, outputs=("output_ids", "HIDDEN_STATES"))
    assert every.error is None and some.error is None
    ids = lambda got: [int(t) for r in got.responses for t in r["output_ids"]]  # noqa: E731
    assert ids(some) == ids(every) and len(ids(some)) == 6
    for name in ("text_output", "finish_reason", "num_output_tokens", "sequence_index"):
        assert all(r[name] is None for r in some.responses), name
        assert any(r[name] is not None for r in every.responses), name
    np.testing.assert_array_equal(some.responses[-1]["HIDDEN_STATES"],
                                  every.responses[-1]["HIDDEN_STATES"])


def test_16_concurrent_streams_equal_alone(triton_server):
    url = triton_server.grpc_url
    modes = ["none", "last", "full", "last"]
    cases = [dict(text_input=f"Story {i}: once upon a time", max_tokens=64, temperature=0.0,
                  ignore_eos=True, MODE=modes[i % 4], stream=True,
                  **({"hidden_layers": [-1, 10]} if modes[i % 4] != "none" else {}))
             for i in range(16)]
    alone = [stream_once(url, c) for c in cases]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda c: stream_once(url, c), cases))
    for got in together:
        assert got.error is None
        assert len(got.cat("output_ids")) == 64
    for i, (a, b) in enumerate(zip(alone, together)):
        mode = modes[i % 4]
        assert list(a.cat("output_ids")) == list(b.cat("output_ids"))
        if mode == "none":
            assert b.cat("HIDDEN_STATES") is None
        else:
            ha, hb = a.cat("HIDDEN_STATES"), b.cat("HIDDEN_STATES")
            assert ha.shape == hb.shape
            # NOTE: batch composition changes float32 rounding, not the tokens
            rel = np.abs(ha - hb).max(axis=1) / np.linalg.norm(ha, axis=1)
            assert rel.max() <= 1e-4


def wait_for_idle(triton_server, timeout: float):
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    deadline = time.time() + timeout
    m = metrics(url)
    while time.time() < deadline:
        m = metrics(url)
        if m.get("llm_requests_running", 1) == 0 and m.get("llm_kv_blocks_in_use", 1) == 0:
            return m
        time.sleep(0.05)
    return m


def test_cancelled_stream_frees_everything_and_next_is_served(triton_server):
    s = GrpcStream(triton_server.grpc_url)
    s.send(dict(text_input="Write a very long essay about the ocean.", max_tokens=2000,
                ignore_eos=True, temperature=0.0, stream=True, MODE="last"))
    first, error = s.queue.get(timeout=120)  # it is streaming
    assert error is None
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    deadline = time.time() + 5  # NOTE: the gauges are refreshed every 0.1 s
    while metrics(url).get("llm_requests_running", 0) < 1 and time.time() < deadline:
        time.sleep(0.02)
    assert metrics(url)["llm_requests_running"] >= 1
    t0 = time.time()
    s.close(cancel=True)
    m = wait_for_idle(triton_server, timeout=5)
    took = time.time() - t0
    assert m["llm_requests_running"] == 0 and m["llm_kv_blocks_in_use"] == 0, m
    assert took <= 1.0, f"cancellation took {took:.2f}s"
    got = stream_once(triton_server.grpc_url, dict(text_input="Next", max_tokens=4, temperature=0.0))
    assert got.error is None and len(got.cat("output_ids")) >= 1


ERRORS = [
    ("llm", dict(text_input="x", MODE="middle"), "MODE"),
    ("llm_capped", dict(text_input="x", MODE="full"), "MODE"),
    ("llm_capped", dict(text_input="x", MODE="last", hidden_layers=[5]), "hidden_layers"),
    ("llm", dict(text_input="x", MODE="last", hidden_layers=[99]), "hidden_layers"),
    ("llm", dict(text_input="x", input_ids=[1, 2]), "text_input"),
    ("llm", dict(max_tokens=3), "text_input"),
    ("llm", dict(text_input="x", max_tokens=5000), "max_tokens"),
    ("llm", dict(input_ids=[5] * 8193), "input_ids"),
    ("llm", dict(text_input="x", sampling_parameters="{not json"), "sampling_parameters"),
    ("llm", dict(text_input="x", sampling_parameters='{"tempreature": 1}'), "sampling_parameters"),
    ("llm", dict(text_input="x", top_p=0.0), "top_p"),
    ("llm", dict(text_input="x", n=0), "n"),
    ("llm_sync", dict(text_input="x", n=2), "n"),
]


@pytest.mark.parametrize("model, fields, name", ERRORS, ids=[f"{e[2]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_input_while_others_stream(triton_server, model, fields, name):
    url = triton_server.grpc_url
    background = GrpcStream(url)
    background.send(dict(text_input="Keep streaming please", max_tokens=40, ignore_eos=True,
                         temperature=0.0, stream=True))
    got = stream_once(url, fields, model=model)
    assert got.error is not None, got.responses
    assert name in got.error.message()
    # the code: gRPC streams carry only the message; HTTP generate maps INVALID_ARG to 400
    status, body = http_generate(triton_server.http_url, model, fields)
    assert status == 400 and name in body["error"], (status, body)
    ok = background.read()
    background.close()
    assert ok.error is None and len(ok.cat("output_ids")) == 40


def test_wrong_dtype_and_shape_refused_by_triton(triton_server):
    url = triton_server.grpc_url
    bad_dtype = stream_once(url, dict(text_input="x"), raw={"max_tokens": np.array([3.5], np.float32)})
    assert bad_dtype.error is not None and "max_tokens" in bad_dtype.error.message()
    bad_shape = stream_once(url, dict(text_input="x"), raw={"max_tokens": np.array([3, 4], np.int32)})
    assert bad_shape.error is not None and "max_tokens" in bad_shape.error.message()


def test_typed_input_wins_over_json(triton_server):
    got = stream_once(triton_server.grpc_url, dict(
        text_input=PROMPT, max_tokens=3, temperature=0.0,
        sampling_parameters='{"max_tokens": 9, "ignore_eos": true}'))
    assert got.error is None
    assert len(got.cat("output_ids")) == 3


def test_hidden_states_in_the_declared_dtype(triton_server):
    """llm_capped declares HIDDEN_STATES as TYPE_BF16: the rows arrive as BF16, equal to the
    float32 rows of `llm` rounded to bfloat16."""
    import tritonclient.grpc as grpcclient

    from triton_helpers import infer_inputs

    fields = dict(text_input=PROMPT, max_tokens=0, MODE="last", hidden_layers=[-1], stream=False)
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    rows = {}
    for model in ("llm", "llm_capped"):
        results: list = []
        client.start_stream(callback=lambda result, error: results.append((result, error)))
        client.async_stream_infer(model, infer_inputs(grpcclient, fields))
        deadline = time.time() + 60
        while not results and time.time() < deadline:
            time.sleep(0.01)
        client.stop_stream()
        result, error = results[0]
        assert error is None, error
        out = result.get_output("HIDDEN_STATES")
        rows[model] = (out.datatype, result.as_numpy("HIDDEN_STATES"))
    assert rows["llm"][0] == "FP32" and rows["llm_capped"][0] == "BF16"
    fp32, bf16 = rows["llm"][1], rows["llm_capped"][1].astype(np.float32)
    expected = torch.tensor(fp32).to(torch.bfloat16).float().numpy()  # NOTE: a copy (read-only)
    np.testing.assert_array_equal(bf16, expected)


@pytest.mark.parametrize("stream", [True, False])
def test_n_completions_tagged_by_sequence_index(triton_server, smollm_engine, stream):
    fields = dict(text_input=PROMPT, max_tokens=6, temperature=0.9, seed=5, n=3, MODE="last",
                  ignore_eos=True)
    req = GenerationRequest(f"ref-n-{stream}", prompt=PROMPT, sampling=SamplingParams(
        max_tokens=6, temperature=0.9, seed=5, n=3, ignore_eos=True),
        hidden_mode=HiddenStatesMode.LAST, hidden_layers=(-1,))
    want = smollm_engine.submit(req).results(timeout=300)
    got = stream_once(triton_server.grpc_url, {**fields, "stream": stream})
    assert got.error is None
    by_index: dict[int, list] = {}
    for r in got.responses:
        by_index.setdefault(int(r["sequence_index"][0]), []).append(r)
    assert sorted(by_index) == [0, 1, 2]
    if not stream:
        assert all(len(rs) == 1 for rs in by_index.values())  # one response per completion
    for i, w in enumerate(want):
        rs = by_index[i]
        ids = np.concatenate([r["output_ids"] for r in rs]).tolist()
        assert ids == w.token_ids
        assert rs[-1]["finish_reason"][0].decode() == "length"
        rows = [r["HIDDEN_STATES"] for r in rs if r["HIDDEN_STATES"] is not None]
        assert len(rows) == 1 and np.allclose(rows[0].astype(np.float32), w.hidden.numpy(), atol=1e-3)
    assert len({tuple(w.token_ids) for w in want}) > 1


def test_prefix_cache_counters_advance_on_a_repeated_prompt(triton_server):
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    before = metrics(url).get("llm_prefix_cache_hit_tokens_total", 0.0)
    fields = dict(text_input="A long shared system prompt. " * 8 + "Hi", max_tokens=2, temperature=0.0)
    first = stream_once(triton_server.grpc_url, fields)
    second = stream_once(triton_server.grpc_url, fields)
    assert first.error is None and second.error is None
    assert first.cat("output_ids").tolist() == second.cat("output_ids").tolist()
    deadline = time.time() + 5
    while metrics(url).get("llm_prefix_cache_hit_tokens_total", 0.0) <= before and time.time() < deadline:
        time.sleep(0.1)
    m = metrics(url)
    assert m["llm_prefix_cache_hit_tokens_total"] >= before + 16, m
    assert m["llm_prefix_cache_query_tokens_total"] >= m["llm_prefix_cache_hit_tokens_total"]
    assert m["llm_kv_blocks_cached"] >= 1


def test_repository_api_needs_the_admin_header(triton_server):
    """Explicit model control makes the repository API live: it is restricted by default."""
    import urllib.error
    import urllib.request

    from hsserve.triton.server import ADMIN_HEADER

    def index(headers):
        req = urllib.request.Request(f"http://{triton_server.http_url}/v2/repository/index",
                                     data=b"{}", method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    assert index({})[0] == 403
    assert index({ADMIN_HEADER: "wrong"})[0] == 403
    status, body = index({ADMIN_HEADER: triton_server.admin_key})
    assert status == 200 and '"llm"' in body
