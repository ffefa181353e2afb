"""TritonPythonModel for the decoupled `llm` model: Triton requests -> engine -> responses.

Threads (STYLE 11): Triton's execute() parses, submits and returns at once; the engine (a child
process, or a thread here) computes, and its deltas reach the ResponseSender (sender.py), which
sends them; the Watcher polls cancellation, refreshes metrics and unloads a model whose engine
died; the DrainWatch ends requests in flight when the server stops (watch.py). finalize() stops
the engine (in-flight requests get an error), then the sender, then the watchers.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np

from hsserve.engine.config import DEFAULT_MODEL, ConfigError
from hsserve.engine.loop import Engine
from hsserve.engine.process import EngineProcess
from hsserve.engine.setup import freeze_heap
from hsserve.request import EngineUnavailable, RequestError
from hsserve.triton.config import split_parameters
from hsserve.triton.inflight import Inflight, InflightRequests
from hsserve.triton.metrics import EngineMetrics
from hsserve.triton.responses import Responses, requested_outputs
from hsserve.triton.sender import ResponseSender
from hsserve.triton.server_watch import ServerWatch, http_live_url
from hsserve.triton.tensors import parse_request
from hsserve.triton.watch import DrainWatch, Watcher

_HIDDEN_DTYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_BF16": "bfloat16"}


def engine_parameters(args: dict, model_config: dict) -> dict[str, str]:
    """config.pbtxt parameters, with the model folder relative to the repository and `auto`
    device resolved to this instance's GPU."""
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    if "hidden_dtype" in params:
        raise ConfigError("hidden_dtype: set by the HIDDEN_STATES output's data_type, not a parameter")
    model = params.get("model", DEFAULT_MODEL)
    if model not in ("", DEFAULT_MODEL) and not os.path.isabs(model):
        params["model"] = os.path.join(args["model_repository"], model)
    if params.get("device", "auto") == "auto" and args.get("model_instance_kind") == "GPU":
        params["device"] = f"cuda:{args['model_instance_device_id']}"
    return params


class TritonPythonModel:
    on_engine_step = None  # NOTE: injected by tests (a subclass): Engine's on_step

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb

        self.pb, log = pb, pb.Logger
        model_config = json.loads(args["model_config"])
        if not pb.using_decoupled_model_transaction_policy(model_config):
            raise pb.TritonModelException("the llm model must be decoupled")
        out = pb.get_output_config_by_name(model_config, "HIDDEN_STATES")
        hidden_dtype = _HIDDEN_DTYPES[out["data_type"]] if out else "float32"
        self.config, engine_config = split_parameters(engine_parameters(args, model_config),
                                                      hidden_dtype)
        if int(np.__version__.split(".")[0]) >= 2:
            log.log_warn(
                f"hsserve: numpy {np.__version__} in the Python backend stub: the python_backend "
                "of tritonserver 2.51 (nvidia-pytriton 0.7) mis-reads TYPE_STRING tensors with "
                "numpy 2 (seen: the stub died on a MODE input; text_output arrived empty); "
                "install numpy<2 (requirements/constraints.txt pins 1.26.4)"
            )
        engine_cls = EngineProcess if self.config.engine_process else Engine
        # NOTE: a load error is raised here, to Triton
        self.engine = engine_cls(engine_config, on_step=self.on_engine_step).start()
        tokenizer = self.engine.info.tokenizer
        decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else None
        self.requests = InflightRequests(Responses(pb, decode), self.engine.abort, log.log_warn)
        self.sender = ResponseSender(self.config.stream_responses_per_s,
                                     self.requests.num_streams, self.requests.deliver,
                                     self.requests.stream_interval).start()
        self._stopping = threading.Event()
        metrics = EngineMetrics(pb, {"model": args["model_name"],
                                     "version": str(args["model_version"])})
        self._watchers = [
            Watcher(self.engine, self.requests, metrics, pb, args["model_name"], self._stopping),
            DrainWatch(ServerWatch(http_live_url()), self.engine, self.requests,
                       self.config.drain_timeout_s, log, self._stopping),
        ]
        for w in self._watchers:
            w.thread.start()
        info = self.engine.info
        log.log_info(f"hsserve: {info.spec.family} {info.spec.num_layers} layers, hidden "
                     f"{info.spec.hidden_size}, ceiling {engine_config.hidden_states_ceiling.label}, "
                     f"max_model_len {info.max_model_len}")
        freeze_heap()  # NOTE: the stub process serves this model for its whole life

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request) -> None:
        """Parse and submit one request; a refusal is its error response (never the batch's)."""
        pb, reqs = self.pb, self.requests
        rid = reqs.new_id(request.request_id())
        state = Inflight(request.get_response_sender())
        try:
            state.outputs = requested_outputs(request)
            # NOTE: one pass over the inputs (get_input_tensor_by_name walks them all per name)
            tensors = {t.name(): t.as_numpy() for t in request.inputs()}
            parsed = parse_request(rid, tensors, request.parameters(),
                                   self.config.default_max_tokens,
                                   self.config.exclude_input_in_output)
            state.stream, state.returns = parsed.stream, parsed.returns
            state.interval = parsed.stream_interval or self.config.stream_interval
            state.echo = parsed.request.prompt if parsed.echo else ""
            reqs.add(rid, state)
            self.engine.submit(parsed.request, sink=self.sender.put)
        except RequestError as e:
            reqs.forget(rid)
            reqs.send_error(state, str(e), pb.TritonError.INVALID_ARG)
        except EngineUnavailable as e:
            reqs.forget(rid)
            reqs.send_error(state, str(e), pb.TritonError.UNAVAILABLE)
        except Exception as e:  # noqa: BLE001 - never let one request break the batch
            reqs.forget(rid)
            code = pb.TritonError.UNAVAILABLE if self._stopping.is_set() else None
            reqs.send_error(state, f"{type(e).__name__}: {e}", code)

    def is_ready(self) -> bool:
        """Model readiness, for python_backend releases that ask the model (a user-defined
        is_ready()); false once the engine has died."""
        return self.engine.healthy

    def finalize(self) -> None:
        self.pb.Logger.log_info("hsserve: finalizing")
        self._stopping.set()
        self.engine.shutdown()  # NOTE: every in-flight request gets its final (error) delta
        self.sender.stop()
        for w in self._watchers:
            w.thread.join(timeout=5)
        for state in self.requests.take_all():
            self.requests.send_error(state, "the server is shutting down",
                                     self.pb.TritonError.UNAVAILABLE)
