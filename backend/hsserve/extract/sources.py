"""Where rows come from: the engine in this process, or a running tritonserver over gRPC
streaming. Both take records in order, keep `concurrency` in flight and give results in order:
(record, (output_ids, rows [n, hidden * layers] in the asked dtype)) or (record, error text)."""

from __future__ import annotations

import queue
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from hsserve.extract.records import Record
from hsserve.extract.shared_memory import OutputRegion, to_tensor
from hsserve.request import GenerationRequest, RequestError, SamplingParams


@dataclass(frozen=True)
class Ask:
    mode: str  # "full" or "last"
    layers: tuple[int, ...]
    max_tokens: int
    dtype: torch.dtype


def in_order(records: Iterable[Record], start, finish, concurrency: int) -> Iterator:
    """start(record) -> handle (or an error text), finish(handle) -> result or error text; at
    most `concurrency` started and not finished; results in record order."""
    window: deque = deque()
    for record in records:
        window.append((record, start(record)))
        if len(window) >= concurrency:
            r, h = window.popleft()
            yield r, h if isinstance(h, str) else finish(h)
    while window:
        r, h = window.popleft()
        yield r, h if isinstance(h, str) else finish(h)


class LocalSource:
    def __init__(self, engine, ask: Ask):
        self.engine, self.ask = engine, ask

    def run(self, records: Iterable[Record], concurrency: int) -> Iterator:
        return in_order(records, self._start, self._finish, concurrency)

    def _start(self, record: Record):
        a = self.ask
        req = GenerationRequest(f"x{record.line}", prompt_ids=record.input_ids,
                                sampling=SamplingParams(max_tokens=a.max_tokens, temperature=0.0),
                                hidden_mode=a.mode, hidden_layers=a.layers)
        try:
            return self.engine.submit(req)
        except RequestError as e:
            return str(e)

    def _finish(self, stream):
        res = stream.result()
        if res.error is not None:
            return res.error
        return list(res.token_ids), res.hidden.to(self.ask.dtype)


class ServerSource:
    """`concurrency` gRPC streams to `llm`, one request in flight on each (a stream's error
    carries no request id); requests carry input_ids (tokenized here: each row's token must be
    known). shared_memory (the admin key): each stream's rows come through a system
    shared-memory region (extract/shared_memory.py) of up to `width` values a row."""

    def __init__(self, url: str, ask: Ask, concurrency: int, model: str = "llm",
                 shared_memory: str | None = None, width: int = 0):
        import tritonclient.grpc as grpcclient

        self.grpc, self.ask, self.model, self.width = grpcclient, ask, model, width
        self._streams = []
        try:
            for _ in range(concurrency):
                client = grpcclient.InferenceServerClient(url)
                box: queue.SimpleQueue = queue.SimpleQueue()
                client.start_stream(callback=lambda result, error, box=box: box.put((result, error)))
                region = OutputRegion(client, shared_memory) if shared_memory else None
                self._streams.append((client, box, region))
                if region is not None:  # NOTE: refused here (key, host) rather than per record
                    region.ensure(1)
        except Exception:
            self.close()
            raise
        self._turn = 0

    def close(self) -> None:
        for client, _, region in self._streams:
            client.stop_stream()  # NOTE: first: the server holds a region until its request ends
            if region is not None:
                region.close()
            client.close()
        self._streams = []

    def run(self, records: Iterable[Record], concurrency: int) -> Iterator:
        # NOTE: in_order finishes requests first in, first out: the stream taken in turn is free
        return in_order(records, self._start, self._finish, min(concurrency, len(self._streams)))

    def _start(self, record: Record):
        a, g = self.ask, self.grpc
        fields = [("input_ids", np.array(record.input_ids, np.int32), "INT32"),
                  ("max_tokens", np.array([a.max_tokens], np.int32), "INT32"),
                  ("temperature", np.array([0.0], np.float32), "FP32"),
                  ("MODE", np.array([a.mode.encode()], np.object_), "BYTES"),
                  ("hidden_layers", np.array(a.layers, np.int32), "INT32"),
                  ("stream", np.array([False]), "BOOL")]
        inputs = []
        for name, arr, dtype in fields:
            inputs.append(g.InferInput(name, list(arr.shape), dtype))
            inputs[-1].set_data_from_numpy(arr)
        client, box, region = self._streams[self._turn]
        self._turn = (self._turn + 1) % len(self._streams)
        outputs = [g.InferRequestedOutput("output_ids")]
        if region is None:
            outputs.append(g.InferRequestedOutput("HIDDEN_STATES"))
        else:  # NOTE: room for every row the request may have, at 4 bytes a value
            region.ensure((len(record.input_ids) + a.max_tokens) * self.width * 4)
            outputs.append(region.requested(g))
        client.async_stream_infer(self.model, inputs, outputs=outputs)
        return box, region

    def _finish(self, handle):
        box, region = handle
        result, error = box.get(timeout=3600)
        if error is not None:
            return error.message() if hasattr(error, "message") else str(error)
        if region is not None:
            rows = region.read(result)
        else:
            rows = result.as_numpy("HIDDEN_STATES")  # NOTE: BF16 as ml_dtypes' bfloat16
            rows = to_tensor(rows, rows.dtype.name == "bfloat16")
        return result.as_numpy("output_ids").tolist(), rows.to(self.ask.dtype)
