"""On CUDA (pytest -m gpu): tokens and rows served by the real tritonserver equal the engine's.

On CUDA through the real tritonserver (pytest -m gpu; needs nvidia-pytriton or a system
tritonserver, and hsserve installed for the Python that runs the stub): tokens and hidden rows
streamed over gRPC equal the engine's own, float32, MODE full / last / none in one batch.

On the lent H200 (no registry): carry the nvidia-pytriton, tritonclient and python-rapidjson wheels
(.whl/), `pip install --no-deps --target /tmp/site .whl/*.whl`, add /tmp/site to PYTHONPATH, and
make hsserve importable by the stub (`pip install --no-deps --no-build-isolation -e .`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from tiny_models import save_gpu_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("pytriton") is None and shutil.which("tritonserver") is None,
                       reason="needs tritonserver (nvidia-pytriton)"),
]

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "model_repository")
PROMPTS = [[(13 * i + 7 * j) % 1000 + 3 for j in range(5 + 9 * i)] for i in range(4)]
MODES = ["full", "last", "none", "full"]
DEVICE = "cuda"
LAYERS = [0, -1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_gpu_llama(str(tmp_path_factory.mktemp("llama")))


def engine_outputs(folder):
    engine = Engine(EngineConfig(model=folder, device=DEVICE, dtype="float32")).start()
    try:
        streams = [engine.submit(GenerationRequest(
            f"e{i}", prompt_ids=p, hidden_mode=HiddenStatesMode.parse(m),
            hidden_layers=tuple(LAYERS) if m != "none" else None,
            sampling=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
            for i, (p, m) in enumerate(zip(PROMPTS, MODES))]
        return [s.result(timeout=300) for s in streams]
    finally:
        engine.shutdown()


def test_served_tokens_and_rows_equal_the_engine(tiny_llama, tmp_path):
    integration = os.path.join(os.path.dirname(__file__), "..", "integration")
    sys.path.insert(0, integration)
    from triton_helpers import GrpcStream

    spec = importlib.util.spec_from_file_location("integration_conftest",
                                                  os.path.join(integration, "conftest.py"))
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)  # NOTE: its repository helpers (set_parameter, add_parameter)

    from hsserve.triton.server import start_server

    want = engine_outputs(tiny_llama)
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "llm"), repo / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    cfg = str(repo / "llm" / "config.pbtxt")
    helpers.set_parameter(cfg, "model", tiny_llama)
    helpers.set_parameter(cfg, "dtype", "float32")
    helpers.add_parameter(cfg, "device", DEVICE)
    server = start_server(str(repo), log_path=str(tmp_path / "server.log"))
    try:
        server.wait_ready(timeout=600, models=("llm",))
        streams = []
        for p, m in zip(PROMPTS, MODES):  # NOTE: all in flight together, as the engine's were
            s = GrpcStream(server.grpc_url)
            rows = dict(MODE=m, hidden_layers=LAYERS) if m != "none" else {}
            s.send(dict(input_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True, stream=True,
                        **rows))
            streams.append(s)
        for s, w, m in zip(streams, want, MODES):
            got = s.read()
            s.close()
            assert got.error is None, str(got.error)
            assert got.cat("output_ids").tolist() == w.token_ids
            rows = [r["HIDDEN_STATES"] for r in got.responses if r.get("HIDDEN_STATES") is not None]
            if m == "none":
                assert not rows
                continue
            rows = np.concatenate(rows)
            assert rows.shape == tuple(w.hidden.shape)
            np.testing.assert_allclose(rows, w.hidden.numpy(), rtol=0, atol=1e-4)
    except BaseException:
        print((tmp_path / "server.log").read_text()[-8000:])  # NOTE: shown with the failure
        raise
    finally:
        server.stop()
