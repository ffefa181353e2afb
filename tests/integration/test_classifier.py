"""The classifier pipeline on the real server equals the head on llm's MODE=last row (Issue 6).

Issue 6: the hidden-state classifier pipeline against the real server: the ensemble equals the
head applied to the llm's MODE=last row, every protocol works, the probe and its clients run."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hsserve.triton.classifier_head import ClassifierHead
from triton_helpers import GrpcStream, http_generate, unary_grpc, unary_http

HEAD = os.path.join(os.path.dirname(__file__), "..", "..", "model_repository", "hidden_classifier", "1")
TEXTS = ["Heavy snow and icy winds will hit the mountains tonight.",
         "The striker scored twice in the derby."]


@pytest.fixture(scope="module")
def head():
    return ClassifierHead.load(HEAD)


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_ensemble_equals_head_on_the_llm_last_row(triton_server, head, max_tokens):
    for text in TEXTS:
        got = unary_http(triton_server.http_url, dict(text_input=text, max_tokens=max_tokens),
                         model="llm_classifier")  # NOTE: the ensemble decodes greedily
        row = unary_grpc(triton_server.grpc_url, dict(text_input=text, max_tokens=max_tokens,
                                                      temperature=0.0, MODE="last",
                                                      hidden_layers=[-1]))
        assert row["HIDDEN_STATES"].shape == (1, 576)
        want = head(torch.from_numpy(row["HIDDEN_STATES"].copy()))[0].numpy()
        probs = got["PROBABILITIES"].reshape(-1)
        np.testing.assert_allclose(probs, want, rtol=0, atol=1e-6)
        assert abs(float(probs.sum()) - 1.0) < 1e-5
        assert got["LABEL"].reshape(-1)[0].decode() == head.labels[int(want.argmax())]
        assert got["output_ids"].tolist() == row["output_ids"].tolist()
        assert len(got["output_ids"]) == max_tokens


def test_head_labels_the_probe_topics(triton_server):
    labels = [unary_http(triton_server.http_url, dict(text_input=t, max_tokens=0),
                         model="llm_classifier")["LABEL"].reshape(-1)[0].decode() for t in TEXTS]
    assert labels == ["weather", "sports"]


def test_ensemble_over_every_protocol(triton_server):
    fields = dict(text_input=TEXTS[0], max_tokens=0)
    want = unary_http(triton_server.http_url, fields, model="llm_classifier")["PROBABILITIES"]
    grpc = unary_grpc(triton_server.grpc_url, fields, model="llm_classifier")["PROBABILITIES"]
    stream = GrpcStream(triton_server.grpc_url)
    stream.send(fields, model="llm_classifier")
    streamed = stream.read()
    stream.close()
    assert streamed.error is None
    status, body = http_generate(triton_server.http_url, "llm_classifier", fields)
    assert status == 200, body
    np.testing.assert_array_equal(grpc, want)
    np.testing.assert_array_equal(streamed.final("PROBABILITIES"), want)
    np.testing.assert_allclose(np.array(body["PROBABILITIES"]).reshape(-1), want.reshape(-1), atol=1e-6)
    assert body["LABEL"] == ["weather"] or body["LABEL"] == "weather"


def test_plain_calls_still_default_to_no_hidden_states(triton_server):
    out = unary_grpc(triton_server.grpc_url, dict(text_input=TEXTS[0], max_tokens=2))
    assert out["HIDDEN_STATES"] is None


def test_classifier_refuses_rows_of_the_wrong_width(triton_server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_server.http_url)
    inp = httpclient.InferInput("HIDDEN_STATES", [1, 100], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 100), np.float32))
    with pytest.raises(Exception) as err:
        client.infer("hidden_classifier", [inp])
    assert "HIDDEN_STATES" in str(err.value) and "576" in str(err.value)


def test_probe_clients(triton_server, tmp_path):
    """The probe trainer (into a scratch folder), the PCA plot and the classify client."""
    from test_clients_and_http import run_example

    out = tmp_path / "head"
    feats = tmp_path / "probe.npz"
    run_example("probe/train_probe.py", "--url", triton_server.grpc_url, "--out", str(out),
                "--save-features", str(feats))
    report = json.loads((out / "probe.json").read_text())
    assert report["accuracy"] >= report["majority_baseline"] + 0.20, report
    trained = ClassifierHead.load(str(out))
    assert trained.labels == ["cooking", "sports", "technology", "weather"]
    png = tmp_path / "pca.png"
    printed = run_example("probe/plot_pca.py", str(feats), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert "weather" in printed
    result = json.loads(run_example("classify.py", TEXTS[1], "--url", triton_server.http_url))
    assert result["label"] == "sports" and abs(sum(result["probabilities"]) - 1) < 1e-3
