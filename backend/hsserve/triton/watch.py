"""The adapter's two watcher threads.

- `Watcher`: polls client cancellation at a bounded rate and turns it into engine aborts,
  refreshes the metrics, and when the engine died asks Triton to unload this model (not ready;
  explicit model control only).
- `DrainWatch`: Triton calls finalize() only after in-flight decoupled requests end, and tells
  the model nothing before (server_watch.py): when the server starts stopping, requests in flight
  may finish within drain_timeout_s, then the rest are ended (UNAVAILABLE). It makes no call into
  the backend, which may be busy unloading other models by then.
"""

from __future__ import annotations

import threading
import time

from hsserve.engine.client import EngineClient
from hsserve.triton.inflight import InflightRequests
from hsserve.triton.metrics import EngineMetrics
from hsserve.triton.server_watch import ServerWatch

CANCEL_POLL_S = 0.1  # how often the watcher looks
CANCEL_PER_REQUEST_S = 0.25  # each request is asked at most this often
READY_POLL_S = 0.5  # how often the server's liveness is read (is it stopping?)


class Watcher:
    def __init__(self, engine: EngineClient, requests: InflightRequests, metrics: EngineMetrics,
                 pb, model_name: str, stopping: threading.Event):
        self.engine, self.requests, self.metrics = engine, requests, metrics
        self.pb, self.model_name, self._stopping = pb, model_name, stopping
        self._unload_asked = False
        self.thread = threading.Thread(target=self._run, name="hsserve-cancel", daemon=True)

    def _run(self) -> None:
        while not self._stopping.wait(CANCEL_POLL_S):
            if self.requests.shutting_down:  # NOTE: no more calls into a backend that is unloading
                return
            if self.engine.died and not self._unload_asked:
                self._unload_asked = True
                self._unload_dead_model()
            try:
                snapshot = self.engine.snapshot()
                if snapshot is not None:
                    self.metrics.refresh(snapshot)
            except Exception as e:  # noqa: BLE001 - metrics must never stop cancellation
                self.pb.Logger.log_warn(f"hsserve: metrics refresh failed: {e}")
            self._poll_cancellations()

    def _poll_cancellations(self) -> None:
        for rid, state in self.requests.due_for_cancel_check(time.monotonic(), CANCEL_PER_REQUEST_S):
            try:
                cancelled = state.is_cancelled()
            except Exception:  # noqa: BLE001 - a closed stream counts as cancelled
                cancelled = True
            if cancelled:
                self.engine.abort(rid)

    def _unload_dead_model(self) -> None:
        """The engine died and ended every request in flight with an error: unloading makes the
        model report not ready (tritonserver 2.51 never asks is_ready()). Asynchronous: Triton
        calls finalize() once the requests in flight have ended."""
        log = self.pb.Logger
        log.log_error(f"hsserve: the engine died ({self.engine.error!r}); "
                      f"unloading model {self.model_name!r}")
        try:
            self.pb.unload_model(self.model_name)
        except Exception as e:  # noqa: BLE001 - not in explicit model-control mode
            log.log_warn(
                f"hsserve: could not unload {self.model_name!r} ({e}): it stays READY while every "
                "request fails with UNAVAILABLE; restart the server. Under "
                "--model-control-mode=explicit a model whose engine died unloads itself (not "
                "ready) and can be reloaded (POST /v2/repository/models/<name>/load)."
            )


class DrainWatch:
    def __init__(self, server: ServerWatch, engine: EngineClient, requests: InflightRequests,
                 drain_timeout_s: float, log, stopping: threading.Event):
        self.server, self.engine, self.requests = server, engine, requests
        self.drain_timeout_s, self.log, self._stopping = drain_timeout_s, log, stopping
        self.thread = threading.Thread(target=self._run, name="hsserve-stopwatch", daemon=True)

    def _run(self) -> None:
        while not self._stopping.wait(READY_POLL_S):
            if self.server.stopping() and len(self.requests):
                self._drain()
                return

    def _drain(self) -> None:
        requests = self.requests
        requests.shutting_down = True
        deadline = time.monotonic() + self.drain_timeout_s
        self.log.log_info(f"hsserve: server stopping; {len(requests)} requests in flight may "
                          f"finish within {self.drain_timeout_s} s")
        while len(requests) and time.monotonic() < deadline:
            if self._stopping.wait(0.05):
                return
        if len(requests):
            self.log.log_info(f"hsserve: ending {len(requests)} requests in flight")
            self.engine.abort_all("the server is shutting down")
