"""TritonPythonModel for the decoupled `llm` model: Triton requests -> engine -> responses.

Threads (STYLE 11): Triton's execute() validates, submits and returns at once; the engine's loop
(in a child process, engine_process.py; or a thread here) computes, and its deltas reach the
outbox (from the engine's receiver thread, or the loop thread itself); the sender thread drains
the outbox, coalesces what piled up per request and calls send(); the watcher thread polls
client cancellation at a bounded rate, turns it into engine aborts, and refreshes the metrics;
when the engine's loop has died it asks Triton to unload this model (not ready; explicit model
control only). finalize() stops the engine (in-flight requests get an error), then the sender,
then the watcher.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hsserve.engine.config import DEFAULT_MODEL, EngineConfig
from hsserve.engine.loop import Engine
from hsserve.engine.process import EngineProcess
from hsserve.request import Delta, EngineUnavailable, FinishReason, RequestError
from hsserve.triton.tensors import OUTPUTS, parse_request
from hsserve.triton.server_watch import ServerWatch, http_live_url
from hsserve.triton.metrics import EngineMetrics

pb_utils = None  # NOTE: bound in initialize(); the module imports without Triton
_STOP = None
_CANCEL_POLL_S = 0.1  # how often the watcher looks; each request is asked at most every 0.25 s
_CANCEL_PER_REQUEST_S = 0.25
_READY_POLL_S = 0.5  # how often the server's liveness is read (is it stopping?)
_GATE_MAX_WAIT_S = 0.01  # NOTE: the longest a response waits for the engine to block on the GPU
_ROUND_DUE = 8  # NOTE: responses held for the budget sent per round of the sender, at most
_ALL_OUTPUTS = frozenset(OUTPUTS)
_HIDDEN_DTYPES = {"TYPE_FP32": torch.float32, "TYPE_FP16": torch.float16, "TYPE_BF16": torch.bfloat16}


@dataclass
class _Inflight:
    sender: object
    stream: bool
    # non-streaming: each completion's deltas, gathered until it finishes
    deltas: dict[int, list[Delta]] = field(default_factory=dict)
    next_cancel_check: float = 0.0
    # NOTE: once the final response is sent Triton frees the request, and asking its sender
    # is_cancelled() then crashes tritonserver (seen: SIGSEGV in
    # TRITONBACKEND_ResponseFactoryIsCancelled). The final send and every is_cancelled() call
    # hold this lock, and nothing is asked after `finished`.
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False
    # NOTE: the outputs the client asked for (all when it named none); only these are built
    outputs: frozenset = _ALL_OUTPUTS

    def send(self, response, final: bool = False) -> None:
        """Send unless the final response has gone (then the request is Triton's no more)."""
        with self.lock:
            if not self.finished:
                self.finished = final
                self.sender.send(response,
                                 flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def send_final(self, response) -> None:
        self.send(response, final=True)

    def is_cancelled(self) -> bool:
        with self.lock:
            return not self.finished and self.sender.is_cancelled()


def _tensor(name: str, value: torch.Tensor):
    """Hidden rows go through DLPack (bf16 has no numpy dtype; no copy)."""
    return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(value.contiguous()))


def _numbers(name: str, values: list[int], dtype) -> object:
    """Small integer outputs from numpy: cheaper in the stub than torch + DLPack (measured with
    tritonserver 2.51, bench/response_cost.py: 79-84 vs 127-143 us to build a token's response)."""
    return pb_utils.Tensor(name, np.asarray(values, dtype=dtype))


def _strings(name: str, values: list[str]):
    return pb_utils.Tensor(name, np.array([v.encode("utf-8") for v in values], dtype=np.object_))


def requested_outputs(request) -> frozenset:
    """The outputs a request asked for, all when it named none. Triton drops unrequested
    outputs from a response anyway; not building them spares the stub's GIL (bench/response_cost.py:
    output_ids alone 26-39 us of Python a response, with text_output and sequence_index 79-84)."""
    return _ALL_OUTPUTS.intersection(request.requested_output_names()) or _ALL_OUTPUTS


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        global pb_utils
        import triton_python_backend_utils as _pb

        pb_utils = _pb
        self.logger = pb_utils.Logger
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must be decoupled")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        model = params.get("model", DEFAULT_MODEL)
        if model not in ("", DEFAULT_MODEL) and not os.path.isabs(model):
            params["model"] = os.path.join(args["model_repository"], model)
        if params.get("device", "auto") == "auto" and args.get("model_instance_kind") == "GPU":
            params["device"] = f"cuda:{args['model_instance_device_id']}"
        config = EngineConfig.from_parameters(params)
        out = pb_utils.get_output_config_by_name(model_config, "HIDDEN_STATES")
        self.hidden_dtype = _HIDDEN_DTYPES[out["data_type"]] if out else torch.float32
        if int(np.__version__.split(".")[0]) >= 2:
            self.logger.log_warn(
                f"hsserve: numpy {np.__version__} in the Python backend stub: the python_backend "
                "of tritonserver 2.51 (nvidia-pytriton 0.7) mis-reads TYPE_STRING tensors with "
                "numpy 2 (seen: the stub died on a MODE input; text_output arrived empty); "
                "install numpy<2 (requirements/constraints.txt pins 1.26.4)"
            )
        # NOTE: a load error is raised here, to Triton
        self.engine = (EngineProcess if config.engine_process else Engine)(config).start()
        self.default_max_tokens = config.default_max_tokens
        self.drain_timeout_s = config.drain_timeout_s
        self.stream_rate = config.stream_responses_per_s
        # NOTE: an engine loop in this process, on a GPU: the sender builds and sends responses
        # while the loop waits for the device (it needs no GIL then); on the CPU the loop's torch
        # compute releases the GIL; in a child process it has a GIL of its own
        in_stub_gpu = not config.engine_process and self.engine.device.type == "cuda"
        self._gate = self.engine.device_wait if in_stub_gpu else None
        self._server_watch = ServerWatch(http_live_url())
        self.model_name = args["model_name"]
        self._unload_asked = False  # NOTE: watcher thread only
        self._shutting_down = False
        self.metrics = EngineMetrics(
            pb_utils, {"model": args["model_name"], "version": str(args["model_version"])}
        )
        self._inflight: dict[str, _Inflight] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._counter = 0
        self._stopping = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="hsserve-sender", daemon=True)
        self._watcher = threading.Thread(target=self._watch_loop, name="hsserve-cancel", daemon=True)
        self._stop_watcher = threading.Thread(
            target=self._stop_watch_loop, name="hsserve-stopwatch", daemon=True
        )
        for t in (self._sender, self._watcher, self._stop_watcher):
            t.start()
        spec = self.engine.spec
        self.logger.log_info(
            f"hsserve: {spec.family} {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"ceiling {config.hidden_states_ceiling.label}, max_model_len {self.engine.max_model_len}"
        )

    # ---- execute: validate, submit, return ----------------------------------------------------

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            with self._lock:
                self._counter += 1
                rid = f"{request.request_id() or 'req'}#{self._counter}"
            state = _Inflight(sender, stream=False)
            try:
                state.outputs = requested_outputs(request)
                # NOTE: one pass over the inputs (get_input_tensor_by_name walks them all per name)
                tensors = {t.name(): t.as_numpy() for t in request.inputs()}
                parsed = parse_request(rid, tensors, request.parameters(), self.default_max_tokens)
                state.stream = parsed.stream
                with self._lock:
                    self._inflight[rid] = state
                self.engine.submit(parsed.request, sink=self._outbox.put)
            except RequestError as e:
                self._forget(rid)
                self._send_error(state, str(e), pb_utils.TritonError.INVALID_ARG)
            except EngineUnavailable as e:
                self._forget(rid)
                self._send_error(state, str(e), pb_utils.TritonError.UNAVAILABLE)
            except Exception as e:  # noqa: BLE001 - never let one request break the batch
                self._forget(rid)
                code = pb_utils.TritonError.UNAVAILABLE if self._stopping.is_set() else None
                self._send_error(state, f"{type(e).__name__}: {e}", code)
        return None

    def _forget(self, rid: str) -> _Inflight | None:
        with self._lock:
            return self._inflight.pop(rid, None)

    def _send_error(self, state: _Inflight, message: str, code=None) -> None:
        err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        try:
            state.send_final(pb_utils.InferenceResponse(error=err))
        except Exception as e:  # noqa: BLE001 - the client may be gone
            self.logger.log_warn(f"hsserve: could not send an error response: {e}")

    def is_ready(self) -> bool:
        """Model readiness, for python_backend releases that ask the model (a user-defined
        is_ready(), added in 2026); false once the engine's loop has died."""
        return self.engine.healthy

    # ---- sender thread ------------------------------------------------------------------------

    def _send_loop(self) -> None:
        """Drain the outbox; per completion, merge what piled up into one response. With a rate
        budget, a completion's next response waits until (streams in flight / budget) seconds
        after its last one, so at 64 streams each response carries several tokens while a lone
        stream still gets every token at once; first and final responses never wait for the budget.
        On a GPU each response also waits for the engine's loop to be blocked on the device or
        idle (a round waits at most _GATE_MAX_WAIT_S in all): two Python threads busy at once slow
        each other through the GIL, and the loop's step is what every stream waits for."""
        held: dict[tuple[str, int], list[Delta]] = {}
        next_at: dict[tuple[str, int], float] = {}
        stop = False
        while not stop or held:
            timeout = None
            if held:
                timeout = max(0.0, min(next_at.get(k, 0.0) for k in held) - time.monotonic())
            batch: list = []
            try:
                if not stop:
                    batch.append(self._outbox.get(timeout=timeout))
                while True:
                    batch.append(self._outbox.get_nowait())
            except queue.Empty:
                pass
            for d in batch:
                if d is _STOP:
                    stop = True
                else:
                    held.setdefault((d.request_id, d.sequence_index), []).append(d)
            now = time.monotonic()
            streams = sum(1 for st in list(self._inflight.values()) if st.stream)
            gap = streams / self.stream_rate if self.stream_rate else 0.0
            gate_until = now + _GATE_MAX_WAIT_S  # NOTE: one bound per round, not per response
            # NOTE: firsts and finals go first (a final frees its client for the next request, a
            # first is its TTFT), then the longest due of the others, at most _ROUND_DUE of them:
            # at 64 streams the budget keeps this thread sending all the time, and a final that
            # waited behind a whole round of them (up to 64 sends) left its client's next request
            # (and its slot in the engine) waiting that long
            urgent, due = [], []
            for key, deltas in held.items():
                if stop or deltas[-1].finished or key not in next_at:
                    urgent.append(key)
                elif now >= next_at[key]:
                    due.append(key)
            # NOTE: a request's last response (request_done) goes after its other completions'
            # finals of this round: once it is sent, the request is forgotten
            urgent.sort(key=lambda k: held[k][-1].request_done)
            due.sort(key=next_at.__getitem__)
            for key in urgent + due[:_ROUND_DUE]:
                final = held[key][-1].finished  # NOTE: request_done comes only on a final delta
                if self._gate is not None and not stop:
                    self._gate.wait(max(0.0, gate_until - time.monotonic()))
                deltas = held.pop(key)
                if final:
                    next_at.pop(key, None)
                else:
                    next_at[key] = now + gap
                self._deliver(key[0], Delta.merge(deltas))

    def _deliver(self, rid: str, delta: Delta) -> None:
        # NOTE: a cancelled or failed completion ends the whole request with one error response
        failed = delta.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR)
        with self._lock:
            state = self._inflight.get(rid)
            if state is not None and (delta.request_done or failed):
                del self._inflight[rid]
        if state is None:
            return
        if not state.stream and not failed:
            state.deltas.setdefault(delta.sequence_index, []).append(delta)
            if not delta.finished:
                return
            delta = Delta.merge(state.deltas.pop(delta.sequence_index))
        try:
            self._send(state, delta)
        except Exception as e:  # noqa: BLE001 - a vanished client must not stop the sender
            self.logger.log_warn(f"hsserve: send failed for {rid}: {e}")
            if not delta.request_done:
                self.engine.abort(rid)
                self._forget(rid)

    def _send(self, state: _Inflight, delta: Delta) -> None:
        if delta.finish_reason == FinishReason.CANCELLED:
            err = pb_utils.TritonError("the request was cancelled", pb_utils.TritonError.CANCELLED)
            state.send_final(pb_utils.InferenceResponse(error=err))
            return
        if delta.finish_reason == FinishReason.ERROR:
            code = pb_utils.TritonError.UNAVAILABLE if self._shutting_down else pb_utils.TritonError.INTERNAL
            err = pb_utils.TritonError(delta.error or "the engine failed", code)
            state.send_final(pb_utils.InferenceResponse(error=err))
            return
        want = state.outputs
        outputs = []
        if "text_output" in want:
            outputs.append(_strings("text_output", [delta.text]))
        if "output_ids" in want:
            outputs.append(_numbers("output_ids", delta.token_ids, np.int32))
        if "sequence_index" in want:
            outputs.append(_numbers("sequence_index", [delta.sequence_index], np.uint32))
        # NOTE: responses without rows omit HIDDEN_STATES
        if delta.hidden is not None and "HIDDEN_STATES" in want:
            outputs.append(_tensor("HIDDEN_STATES", delta.hidden.to(self.hidden_dtype)))
        if delta.finished:
            if "finish_reason" in want:
                outputs.append(_strings("finish_reason", [delta.finish_reason.value]))
            for name in ("num_input_tokens", "num_output_tokens"):
                if name in want:
                    outputs.append(_numbers(name, [getattr(delta, name)], np.uint32))
        state.send(pb_utils.InferenceResponse(output_tensors=outputs), final=delta.request_done)

    # ---- cancellation watcher -----------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stopping.wait(_CANCEL_POLL_S):
            if self._shutting_down:  # NOTE: no more calls into a backend that is unloading
                return
            if self.engine.died and not self._unload_asked:
                self._unload_asked = True
                self._unload_dead_model()
            try:
                snapshot = self.engine.snapshot()
                if snapshot is not None:
                    self.metrics.refresh(snapshot)
            except Exception as e:  # noqa: BLE001 - metrics must never stop cancellation
                self.logger.log_warn(f"hsserve: metrics refresh failed: {e}")
            self._poll_cancellations()

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(rid, s) for rid, s in self._inflight.items() if s.next_cancel_check <= now]
            for _, state in due:
                state.next_cancel_check = now + _CANCEL_PER_REQUEST_S
        for rid, state in due:
            try:
                cancelled = state.is_cancelled()
            except Exception:  # noqa: BLE001 - a closed stream counts as cancelled
                cancelled = True
            if cancelled:
                self.engine.abort(rid)

    def _unload_dead_model(self) -> None:
        """The engine's loop died and has ended every request in flight with an error: unload
        this model so that it reports not ready (tritonserver 2.51 never asks is_ready()).
        NOTE: the unload is asynchronous; Triton calls finalize() once the requests in flight
        have ended. Only explicit model control allows it; otherwise the model stays READY."""
        self.logger.log_error(
            f"hsserve: the engine died ({self.engine.error!r}); unloading model {self.model_name!r}"
        )
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as e:  # noqa: BLE001 - not in explicit model-control mode
            self.logger.log_warn(
                f"hsserve: could not unload {self.model_name!r} ({e}): it stays READY while every "
                "request fails with UNAVAILABLE; restart the server. Under "
                "--model-control-mode=explicit a model whose engine died unloads itself (not "
                "ready) and can be reloaded (POST /v2/repository/models/<name>/load)."
            )

    # ---- shutdown -----------------------------------------------------------------------------

    def _stop_watch_loop(self) -> None:
        """Triton calls finalize() only after in-flight decoupled requests end (server_state.py):
        when the server starts stopping they may finish within drain_timeout_s, then the rest are
        ended here, with UNAVAILABLE. This thread makes no call into the backend, which may be
        busy unloading other models by then."""
        while not self._stopping.wait(_READY_POLL_S):
            if self._server_watch.stopping() and self._inflight:
                self._shutting_down = True
                deadline = time.monotonic() + self.drain_timeout_s
                self.logger.log_info(
                    f"hsserve: server stopping; {len(self._inflight)} requests in flight may finish "
                    f"within {self.drain_timeout_s} s"
                )
                while self._inflight and time.monotonic() < deadline:
                    if self._stopping.wait(0.05):
                        return
                if self._inflight:
                    self.logger.log_info(f"hsserve: ending {len(self._inflight)} requests in flight")
                    self.engine.abort_all("the server is shutting down")
                return

    def finalize(self) -> None:
        self.logger.log_info("hsserve: finalizing")
        self._stopping.set()
        self.engine.shutdown()  # NOTE: every in-flight request gets its final (error) delta
        self._outbox.put(_STOP)
        self._sender.join(timeout=30)
        self._watcher.join(timeout=5)
        self._stop_watcher.join(timeout=5)
        with self._lock:
            left = list(self._inflight.values())
            self._inflight.clear()
        for state in left:
            self._send_error(state, "the server is shutting down", pb_utils.TritonError.UNAVAILABLE)
