"""Proves `hsserve openai` serves the OpenAI API to the `openai` SDK over the real tritonserver.

Completions (echo + logprobs equal to the llm model's own prompt logprobs, hidden states as
base64 float32 rows equal to llm's), streamed chat with usage, errors naming the field,
response_format (json_schema, json_object) and vLLM's guided_* extras, n > 1, batched prompts
with stop strings; the llm model's own sampling_parameters.guided_decoding beside them; and
`hsserve serve --openai` starting and stopping both servers; lm-evaluation-harness'
local-completions scoring as its hf model."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from hsserve.triton.server import free_ports
from triton_helpers import stream_once


@pytest.fixture(scope="module")
def gateway(triton_server, smollm_dir):
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "hsserve.cli", "openai", "--port", str(port),
                             "--host", "127.0.0.1", "--grpc-url", triton_server.grpc_url,
                             "--tokenizer", smollm_dir, "--served-model-name", "smol"])
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "the gateway did not start"
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _client(url):
    import openai

    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_completion_echo_logprobs_and_rows_equal_llms(gateway, triton_server):
    prompt = "The capital of France is"
    r = _client(gateway).completions.create(
        model="smol", prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True,
        extra_body={"hidden_states": {"mode": "full", "layers": [-1]}})
    choice = r.choices[0]
    direct = stream_once(triton_server.grpc_url, {
        "text_input": prompt, "max_tokens": 6, "temperature": 0.0, "MODE": "full",
        "hidden_layers": [-1], "prompt_logprobs": 2, "num_logprobs": 2})
    text = "".join(b"".join(x["text_output"]).decode() for x in direct.responses)
    assert choice.text == prompt + text
    prompt_lps = direct.responses[0]["prompt_token_logprobs"].tolist()
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and np.allclose(lps[1:len(prompt_lps)], prompt_lps[1:], atol=1e-5)
    out = np.concatenate([x["output_logprobs"] for x in direct.responses if
                          x["output_logprobs"] is not None])
    assert np.allclose(lps[len(prompt_lps):], out, atol=1e-5)
    hs = choice.model_extra["hidden_states"]
    rows = np.frombuffer(base64.b64decode(hs["data"]), "<f4").reshape(hs["shape"])
    ref = np.concatenate([x["HIDDEN_STATES"] for x in direct.responses
                          if x["HIDDEN_STATES"] is not None])
    assert rows.shape == ref.shape and np.allclose(rows, ref, atol=1e-5)
    assert r.usage.prompt_tokens == len(prompt_lps) and r.usage.completion_tokens == 6


def test_streamed_chat_with_usage_and_errors(gateway):
    import openai

    client = _client(gateway)
    chunks = list(client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
        temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[-1].usage.completion_tokens == 5 == whole.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", max_tokens=10**8)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", extra_body={
            "hidden_states": {"mode": "all"}})
    assert e.value.body["param"] == "hidden_states.mode"


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "rank": {"type": "integer"}},
          "required": ["city", "rank"], "additionalProperties": False}


def test_structured_outputs_n_and_batched_prompts(gateway, triton_server):
    import jsonschema
    import openai

    client = _client(gateway)
    msgs = [{"role": "user", "content": "Name a city and its rank as JSON."}]
    r = client.chat.completions.create(
        model="smol", messages=msgs, max_tokens=40, temperature=0.8, seed=5, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = client.chat.completions.create(
        model="smol", max_tokens=60, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with keys city and country "
                   "for Paris."}])
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = client.completions.create(model="smol", prompt=["Yes or no?", "Red or blue?"],
                                     max_tokens=5, temperature=0,
                                     extra_body={"guided_choice": ["yes", "no", "red", "blue"]})
    assert sorted(c.index for c in pick.choices) == [0, 1]
    assert all(c.text in ("yes", "no", "red", "blue") for c in pick.choices)
    free = client.completions.create(model="smol", prompt=["One, two,", "A, B,"], max_tokens=12,
                                     temperature=0, stop=[","])
    assert all("," not in c.text and c.finish_reason == "stop" for c in free.choices)
    direct = stream_once(triton_server.grpc_url, {
        "text_input": "Name a city and its rank as JSON.", "max_tokens": 40,
        "sampling_parameters": json.dumps({"temperature": 0, "guided_decoding": {
            "json": SCHEMA}})})
    text = "".join(b"".join(x["text_output"]).decode() for x in direct.responses)
    jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smol", prompt="x", extra_body={"guided_regex": "(ab"})
    assert e.value.body["param"] == "guided_regex" and "regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smol", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format"


def test_serve_with_openai_starts_and_stops_both(tmp_path, smollm_dir):
    """`hsserve serve --openai` (scripts/serve.sh --openai): the gateway comes up beside
    tritonserver on the same model, and Ctrl-C stops both."""
    import shutil
    import signal

    from conftest import make_repository

    repo = make_repository(str(tmp_path), smollm_dir)
    for name in os.listdir(repo):
        if name != "llm":
            shutil.rmtree(os.path.join(repo, name))
    http, grpc, metrics, port = free_ports(4)
    proc = subprocess.Popen([sys.executable, "-m", "hsserve.cli", "serve", "--model-repository",
                             repo, "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics), "--wait-for", "llm", "--openai",
                             "--openai-port", str(port)])
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 300
        while True:
            try:
                models = json.load(urllib.request.urlopen(f"{url}/models", timeout=2))
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "serve --openai failed"
                time.sleep(1)
        name = models["data"][0]["id"]
        r = _client(url).completions.create(model=name, prompt="Hello", max_tokens=3,
                                            temperature=0)
        assert r.usage.completion_tokens == 3
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/models", timeout=2)


def _lm_eval_tasks(folder: str) -> str:
    """The two local tasks over tests/data/lm_eval (one loglikelihood, one generate_until)."""
    data = os.path.join(os.path.dirname(__file__), "..", "data", "lm_eval")
    common = dict(dataset_path="json", test_split="test", doc_to_text="{{question}}",
                  doc_to_target="{{answer}}")
    tasks = {
        "hs_mc": dict(common, output_type="multiple_choice", doc_to_choice="{{choices}}",
                      metric_list=[{"metric": "acc"}]),
        "hs_gen": dict(common, output_type="generate_until", generation_kwargs={
            "until": ["\n", "."], "max_gen_toks": 10, "do_sample": False},
                       metric_list=[{"metric": "exact_match", "ignore_case": True,
                                     "ignore_punctuation": True}]),
    }
    for name, file in (("hs_mc", "multiple_choice"), ("hs_gen", "generate_until")):
        tasks[name].update(task=name, dataset_kwargs={"data_files": {
            "test": os.path.abspath(os.path.join(data, f"{file}.jsonl"))}})
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            json.dump(tasks[name], f)  # NOTE: JSON is YAML
    return folder


def test_lm_eval_local_completions_scores_equal_transformers(gateway, smollm_dir, tmp_path):
    """lm-evaluation-harness' local-completions (token-id prompts, echo + logprobs for the
    loglikelihoods, stop strings for generation) scores as its hf model on the same weights."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=_lm_eval_tasks(str(tmp_path)))
    runs = {
        "served": simple_evaluate(model="local-completions", model_args={
            "model": "smol", "base_url": f"{gateway}/completions", "tokenizer": smollm_dir,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1,
            "num_concurrent": 4}, tasks=["hs_mc", "hs_gen"], task_manager=tasks, log_samples=True),
        "hf": simple_evaluate(model="hf", model_args={
            "pretrained": smollm_dir, "dtype": "float32", "device": "cpu"},
            tasks=["hs_mc", "hs_gen"], task_manager=tasks, log_samples=True, batch_size=1),
    }
    served, hf = runs["served"], runs["hf"]
    for task, metric in (("hs_mc", "acc,none"), ("hs_gen", "exact_match,none")):
        assert served["results"][task][metric] == hf["results"][task][metric], task
    mc = [(s["doc_id"], s["filtered_resps"]) for s in served["samples"]["hs_mc"]]
    ref = dict((s["doc_id"], s["filtered_resps"]) for s in hf["samples"]["hs_mc"])
    for doc, lls in mc:
        assert np.allclose([x[0] for x in lls], [x[0] for x in ref[doc]], atol=1e-4), doc
    gen = {s["doc_id"]: s["filtered_resps"] for s in served["samples"]["hs_gen"]}
    assert gen == {s["doc_id"]: s["filtered_resps"] for s in hf["samples"]["hs_gen"]}
    assert served["results"]["hs_mc"]["acc,none"] >= 0.5  # NOTE: SmolLM2 knows these


def test_a_client_leaving_a_whole_answer_cancels_its_requests(gateway, triton_server):
    """A non-streamed request whose client disconnects stops generating at once (its Triton
    requests cancelled), not after its 3,000 tokens (~a minute here)."""
    import http.client
    import socket

    from triton_helpers import metrics

    host, port = gateway.split("//")[1].split("/")[0].split(":")
    url = f"http://127.0.0.1:{triton_server.ports.metrics}/metrics"
    conn = http.client.HTTPConnection(host, int(port), timeout=3)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "smol", "prompt": "Tell a long story.", "max_tokens": 3000, "ignore_eos": True}),
        {"Content-Type": "application/json"})
    deadline = time.time() + 30
    while metrics(url, "llm").get("llm_requests_running", 0) < 1:
        assert time.time() < deadline, "the request never ran"
        time.sleep(0.2)
    with pytest.raises(socket.timeout):
        conn.getresponse()
    conn.close()
    deadline = time.time() + 20
    while metrics(url, "llm").get("llm_requests_running", 0) > 0:
        assert time.time() < deadline, "the engine still generates for a client that left"
        time.sleep(0.2)
