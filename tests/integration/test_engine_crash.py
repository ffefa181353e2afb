"""A real server's engine loop dying errors its streams and unloads that model only (Issue 7).

Issue 7: the engine loop of a real server dies (a crash hook injected by its model.py) while three
streams generate. Each ends with an error at once, the model unloads itself (not ready), a new
request is refused with Triton's message, another model keeps serving meanwhile, the model can be
reloaded, and the server then stops cleanly."""

from __future__ import annotations

import json
import os
import queue
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient
from conftest import add_parameter, make_repository
from crash_hook import MESSAGE, crashing_model_py
from hsserve.triton.server import ADMIN_HEADER, start_server
from triton_helpers import infer_inputs, stream_once, stub_processes

CRASH_AFTER_STEPS = 60  # NOTE: ~3 s of three streams on a 2-core CPU; llm_capped stays below it
ENDLESS = dict(max_tokens=3000, ignore_eos=True, stream=True, temperature=0.0)


class TimedStream:
    """A gRPC stream whose responses are stamped when they arrive."""

    def __init__(self, url: str, prompt: str):
        self.client = grpcclient.InferenceServerClient(url)
        self.queue: queue.Queue = queue.Queue()
        self.client.start_stream(
            callback=lambda result, error: self.queue.put((result, error, time.monotonic()))
        )
        inputs = infer_inputs(grpcclient, dict(text_input=prompt, **ENDLESS))
        self.client.async_stream_infer("llm", inputs)

    def read_to_error(self, timeout: float = 60.0) -> tuple[int, Exception | None, float]:
        """(responses before the end, the error, seconds from the last response to the error)."""
        n, last = 0, None
        while True:
            _, error, at = self.queue.get(timeout=timeout)
            if error is not None:
                return n, error, at - (last or at)
            n, last = n + 1, at

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def http(server, path: str, post: bool = False) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=b"" if post else None,
                                 method="POST" if post else "GET",
                                 headers={ADMIN_HEADER: server.admin_key})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def model_ready(server) -> bool:
    return http(server, "/v2/models/llm/ready")[0] == 200


def llm_state(server) -> tuple[str, str]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}",
                                 method="POST", headers={ADMIN_HEADER: server.admin_key})
    with urllib.request.urlopen(req, timeout=10) as r:
        index = json.loads(r.read().decode())
    entry = next(m for m in index if m["name"] == "llm")
    return entry["state"], entry.get("reason", "")


def wait_until(predicate, timeout: float) -> float | None:
    """Seconds until predicate() held, or None."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@pytest.fixture(scope="module")
def crashed(tmp_path_factory, smollm_dir):
    root = tmp_path_factory.mktemp("crash")
    repo = make_repository(str(root), smollm_dir)
    # NOTE: a sibling that would end its requests after 0.5 s if it took the unload (server
    # readiness false) for a server shutdown
    add_parameter(os.path.join(repo, "llm_capped", "config.pbtxt"), "drain_timeout_s", "0.5")
    with open(os.path.join(repo, "llm", "1", "model.py"), "w") as f:
        f.write(crashing_model_py(CRASH_AFTER_STEPS))
    server = start_server(repo, log_path=str(root / "server.log"))
    marker = server.command.backend_dir or repo
    out: dict = {"server": server}
    streams: list[TimedStream] = []
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_capped"))
        streams += [TimedStream(server.grpc_url, f"Endless story {i}") for i in range(3)]
        for s in streams:  # all are generating
            _, error, _ = s.queue.get(timeout=120)
            assert error is None, error
        out["ended"] = [s.read_to_error() for s in streams]
        out["unready_after"] = wait_until(lambda: not model_ready(server), 10)
        # NOTE: Triton finishes the unload once the clients have closed the failed streams
        out["state_while_unloading"] = llm_state(server)
        out["server_ready_while_unloading"] = http(server, "/v2/health/ready")[0]
        out["sibling"] = stream_once(server.grpc_url, dict(text_input="A sibling", max_tokens=30,
                                                           ignore_eos=True, temperature=0.0),
                                     model="llm_capped")
        out["late"] = stream_once(server.grpc_url, dict(text_input="Too late", max_tokens=3))
        while streams:
            streams.pop().close()
        out["unloaded_after"] = wait_until(lambda: llm_state(server)[0] == "UNAVAILABLE", 30)
        out["state_after_unload"] = llm_state(server)
        out["server_ready_after_unload"] = http(server, "/v2/health/ready")[0]
        out["load"] = http(server, "/v2/repository/models/llm/load", post=True)
        out["ready_after_load"] = model_ready(server)
        out["after_load"] = stream_once(server.grpc_url, dict(text_input="Back", max_tokens=3,
                                                              ignore_eos=True))
        t0 = time.monotonic()
        out["returncode"] = server.stop(timeout=60)
        out["stop_s"] = time.monotonic() - t0
        out["stubs_left"] = stub_processes(marker)
        yield out
    finally:
        for s in streams:
            s.close()
        server.stop()


def test_pending_streams_end_with_an_error_right_after_the_engine_dies(crashed):
    assert len(crashed["ended"]) == 3
    for n, error, gap in crashed["ended"]:
        assert n >= 1  # NOTE: it died mid-generation
        assert error is not None and "the engine stopped" in error.message(), error
        assert MESSAGE in error.message()
        assert gap < 5.0, gap


def test_the_model_turns_unready(crashed):
    assert crashed["unready_after"] is not None and crashed["unready_after"] < 5.0
    assert crashed["state_while_unloading"][0] == "UNLOADING"


def test_a_new_request_gets_a_clear_error(crashed):
    late = crashed["late"]
    assert late.error is not None and not late.responses
    assert "Request for unknown model: 'llm' has no available versions" in late.error.message()


def test_other_models_keep_serving_while_it_unloads(crashed):
    sibling = crashed["sibling"]
    assert sibling.error is None, sibling.error
    assert len(sibling.cat("output_ids")) == 30 and sibling.final("finish_reason")[0] == b"length"


def test_server_readiness_is_false_only_while_the_model_unloads(crashed):
    # NOTE: strict readiness counts a model being unloaded, not one unloaded on purpose
    assert crashed["server_ready_while_unloading"] == 400
    assert crashed["unloaded_after"] is not None
    assert crashed["state_after_unload"] == ("UNAVAILABLE", "unloaded")
    assert crashed["server_ready_after_unload"] == 200


def test_it_can_be_reloaded(crashed):
    assert crashed["load"][0] == 200, crashed["load"]
    assert crashed["ready_after_load"]
    back = crashed["after_load"]
    assert back.error is None, back.error
    assert len(back.cat("output_ids")) == 3


def test_the_server_then_stops_cleanly(crashed):
    assert crashed["returncode"] == 0 and crashed["stop_s"] < 30
    assert not crashed["stubs_left"], crashed["stubs_left"]
    assert crashed["server"].process.poll() is not None
