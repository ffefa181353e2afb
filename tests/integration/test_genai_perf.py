"""genai-perf's requests for llm fit the model's inputs and are all served (Issue 25).

Issue 25: genai-perf (the real tool, from PyPI) can benchmark `llm`. perf_analyzer's binary is not
on the registries, so genai-perf stops after writing its inputs.json; this test checks those
inputs with perf_analyzer's data-loader rules (every key but `model` is an input of the model,
every non-optional input is there, values fit the config's datatypes and dims) and sends every
request over gRPC streaming, each answered with text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from triton_helpers import GrpcStream

GENAI_PERF = os.path.join(os.path.dirname(sys.executable), "genai-perf")
NUMPY = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32,
         "TYPE_UINT32": np.uint32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64,
         "TYPE_FP32": np.float32}


def genai_perf_inputs(tmp_path, url: str, backend: str, streaming: bool, tokenizer: str) -> list:
    art = tmp_path / f"{backend}-{streaming}"
    cmd = [GENAI_PERF, "profile", "-m", "llm", "--backend", backend, "--endpoint-type", "kserve",
           "--url", url, "--tokenizer", tokenizer, "--num-prompts", "4",
           "--synthetic-input-tokens-mean", "16", "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", "6", "--output-tokens-mean-deterministic",
           "--artifact-dir", str(art)] + (["--streaming"] if streaming else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    found = [os.path.join(d, f) for d, _, fs in os.walk(art) for f in fs if f == "inputs.json"]
    assert found, run.stdout[-2000:] + run.stderr[-2000:]
    with open(found[0]) as f:
        return json.load(f)["data"]


def typed(entry: dict, config_inputs: dict) -> dict[str, np.ndarray]:
    """perf_analyzer's reading of one inputs.json entry, refusing what it would refuse."""
    out = {}
    for key, values in entry.items():
        if key == "model":
            continue
        assert key in config_inputs, f"{key!r} is not an input of llm (perf_analyzer refuses it)"
        spec = config_inputs[key]
        dtype = NUMPY[spec["data_type"]]
        if dtype is np.object_:
            arr = np.array([v.encode() for v in values], dtype=np.object_)
        else:
            arr = np.array(values, dtype=dtype)
            assert np.array_equal(arr, np.array(values)), (key, values, spec["data_type"])
        dims = [int(d) for d in spec["dims"]]
        assert all(d == -1 for d in dims) or arr.size == int(np.prod(dims)), (key, values, dims)
        out[key] = arr.reshape(dims if -1 not in dims else (-1,))
    required = [n for n, s in config_inputs.items() if not s.get("optional", False)]
    assert not [n for n in required if n not in out], required
    return out


@pytest.mark.parametrize("backend", ["vllm", "tensorrtllm"])
@pytest.mark.parametrize("streaming", [True, False])
def test_genai_perf_requests_are_served(triton_server, smollm_dir, tmp_path, backend, streaming):
    entries = genai_perf_inputs(tmp_path, triton_server.grpc_url, backend, streaming, smollm_dir)
    assert len(entries) == 4
    with urllib.request.urlopen(f"http://{triton_server.http_url}/v2/models/llm/config",
                                timeout=30) as r:
        config = json.loads(r.read().decode())
    config_inputs = {i["name"]: i for i in config["input"]}
    stream = GrpcStream(triton_server.grpc_url)
    try:
        for entry in entries:
            stream.send({}, raw=typed(entry, config_inputs))
            got = stream.read()
            assert got.error is None, (entry, got.error)
            assert got.cat("text_output"), entry
            assert len(got.cat("output_ids")) == 6, "max_tokens 6 and min tokens 6 (deterministic)"
    finally:
        stream.close()
