"""The client examples and the README's HTTP generate calls work against the real server."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from triton_helpers import http_generate, unary_grpc

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "client_examples")


def run_example(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_grpc_stream_example(triton_server):
    out = run_example("grpc_stream.py", "The capital of France is", "--url", triton_server.grpc_url,
                      "--max-tokens", "8", "--mode", "full", "--layers", "-1", "0")
    assert "Paris" in out
    assert "finish_reason=length" in out
    assert "HIDDEN_STATES shape: (13, 1152)" in out  # 5 prompt tokens + 8 generated, 2 layers


def test_http_generate_example(triton_server):
    out = run_example("http_generate.py", "The capital of France is", "--url",
                      f"http://{triton_server.http_url}", "--max-tokens", "6")
    assert "Paris" in out and "HIDDEN_STATES: 576 values" in out


def test_extract_hidden_states_example(triton_server, tmp_path):
    prompts = ["I love this movie.", "This was terrible.", "The weather is nice today."]
    src = tmp_path / "prompts.txt"
    src.write_text("\n".join(prompts) + "\n")
    dst = tmp_path / "h.npy"
    run_example("extract_hidden_states.py", str(src), str(dst), "--url", triton_server.grpc_url,
                "--layers", "-1", "20")
    arr = np.load(dst)
    assert arr.shape == (3, 1152) and arr.dtype == np.float32
    direct = unary_grpc(triton_server.grpc_url, dict(text_input=prompts[1], max_tokens=0,
                                                     MODE="last", hidden_layers=[-1, 20]))
    np.testing.assert_array_equal(arr[1], direct["HIDDEN_STATES"][0])


def test_http_generate_and_stream_readme_calls(triton_server):
    status, out = http_generate(triton_server.http_url, "llm", {
        "text_input": "The capital of France is", "max_tokens": 8, "temperature": 0, "MODE": "last"})
    assert status == 200
    assert "Paris" in out["text_output"] and out["finish_reason"] == "length"
    assert len(out["HIDDEN_STATES"]) == 576
    status, events = http_generate(triton_server.http_url, "llm", {
        "text_input": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True},
        stream=True)
    assert status == 200 and len(events) >= 2
    assert "".join(e["text_output"] for e in events) == out["text_output"]
    assert events[-1]["finish_reason"] == "length"
