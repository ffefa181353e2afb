"""Stopping a server mid-stream drains, errors the rest, exits in time and leaves no process.

Stopping the server while requests stream: a short one finishes within the drain period, the
endless ones end with an error right after it, the server exits within its exit timeout, and no
process is left behind."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from conftest import add_parameter, make_repository
from hsserve.triton.server import start_server
from triton_helpers import GrpcStream, Streamed, alive, stub_children, stub_processes

EXIT_TIMEOUT_S = 10
DRAIN_S = 2.0
SHORT_TOKENS = 12


@pytest.fixture(scope="module")
def stopped_server(tmp_path_factory, smollm_dir):
    """Start a server, stream 3 endless requests, SIGTERM it; report what happened."""
    root = tmp_path_factory.mktemp("shutdown")
    repo = make_repository(str(root), smollm_dir)
    add_parameter(os.path.join(repo, "llm", "config.pbtxt"), "drain_timeout_s", str(DRAIN_S))
    server = start_server(repo, log_path=str(root / "server.log"), exit_timeout_s=EXIT_TIMEOUT_S)
    marker = server.command.backend_dir or repo  # NOTE: each server's stubs run from its own dir
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_sync", "llm_capped"))
        had_stubs = bool(stub_processes(marker))
        children = stub_children(marker)  # NOTE: the llm models' engine processes
        streams = []
        for i in range(3):
            s = GrpcStream(server.grpc_url)
            s.send(dict(text_input=f"Endless story {i}", max_tokens=3000, ignore_eos=True, stream=True,
                        temperature=0.0, MODE="last"))
            streams.append(s)
        for s in streams:  # all are generating
            _, error = s.queue.get(timeout=120)
            assert error is None
        # NOTE: the adapter counts a refused readiness probe as "stopping" only once the endpoint
        # has answered it (every 0.5 s): give it that first answer, as any real server has
        time.sleep(1.5)
        short = GrpcStream(server.grpc_url)
        short.send(dict(text_input="A short answer", max_tokens=SHORT_TOKENS, ignore_eos=True,
                        stream=True, temperature=0.0))
        # NOTE: the model must hold it when the server starts stopping (a request Triton has not
        # yet handed over may be refused): its first token says so
        first = short.read(timeout=120, first_only=True)
        t0 = time.time()
        server.process.send_signal(15)
        rest = short.read(timeout=30)
        drained = Streamed(first.responses + rest.responses, rest.error)
        ended = [s.read(timeout=30) for s in streams]
        error_after = time.time() - t0
        for s in streams + [short]:
            s.close()
        try:
            server.process.wait(EXIT_TIMEOUT_S + 5)
            exited_in_time = True
        except subprocess.TimeoutExpired:
            exited_in_time = False
        server.stop(timeout=60)
        yield dict(had_stubs=had_stubs, children=children, children_left=alive(children),
                   ended=ended, drained=drained, first=first, error_after=error_after,
                   exited_in_time=exited_in_time, stubs_left=stub_processes(marker), server=server)
    finally:
        server.stop()


def test_a_short_request_finishes_within_the_drain_period(stopped_server):
    got = stopped_server["drained"]
    assert got.error is None, got.error
    assert len(stopped_server["first"].cat("output_ids")) < SHORT_TOKENS, "finished before the stop"
    assert len(got.cat("output_ids")) == SHORT_TOKENS and got.final("finish_reason")[0] == b"length"


def test_streams_end_with_an_error_after_the_drain_period(stopped_server):
    for got in stopped_server["ended"]:
        assert got.error is not None, "a stream ended without an error"
        # NOTE: our UNAVAILABLE response, or (a race inside Triton) the gRPC endpoint closing
        # the stream first; either way the client learns it at once, not at the exit timeout
        message = got.error.message()
        assert "shutting down" in message or "GOAWAY" in message or "Socket closed" in message
    assert DRAIN_S <= stopped_server["error_after"] < DRAIN_S + 4.0


def test_no_process_is_left(stopped_server):
    assert stopped_server["had_stubs"]
    assert not stopped_server["stubs_left"], stopped_server["stubs_left"]
    assert stopped_server["children"], "llm's engine process"
    assert not stopped_server["children_left"], stopped_server["children_left"]
    assert stopped_server["server"].process.poll() is not None
    assert not os.path.exists(stopped_server["server"].command.backend_dir or "/nonexistent")


def test_server_exits_within_exit_timeout(stopped_server):
    # NOTE: Triton unloads the model once the clients have closed their ended streams
    assert stopped_server["exited_in_time"]
