"""Triton underneath: one gRPC bidirectional stream per prompt to the decoupled `llm` model
(tritonclient's asyncio client), its responses turned into Pieces.

The stream stays open until each of the n completions has sent its finish_reason (tritonclient's
asyncio stream cannot ask for Triton's empty final response); leaving early (the HTTP client went
away) cancels the call, and Triton cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator

import numpy as np


class BackendError(Exception):
    """Triton's error for one request (errors.from_backend maps it)."""


@dataclass
class Piece:
    """One response of the `llm` model: one completion's next tokens."""
    index: int  # sequence_index: which of the n completions
    text: str
    token_ids: list[int]
    logprobs: np.ndarray | None = None  # [tokens]
    top_ids: np.ndarray | None = None  # [tokens, k]
    top_logprobs: np.ndarray | None = None
    hidden: np.ndarray | None = None  # float32 [rows, features]
    prompt_logprobs: np.ndarray | None = None  # [prompt] (NaN first)
    prompt_top_ids: np.ndarray | None = None  # [prompt, k]
    prompt_top_logprobs: np.ndarray | None = None
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


def _piece(result) -> Piece:
    def arr(name):
        return result.as_numpy(name)

    def scalar(name):
        v = arr(name)
        return None if v is None else v.reshape(-1)[0]

    text = arr("text_output")
    ids = arr("output_ids")
    reason = scalar("finish_reason")
    hidden = arr("HIDDEN_STATES")
    seq, n_in, n_out = scalar("sequence_index"), scalar("num_input_tokens"), \
        scalar("num_output_tokens")
    return Piece(
        index=int(seq) if seq is not None else 0,
        text=b"".join(text.reshape(-1)).decode("utf-8") if text is not None else "",
        token_ids=ids.reshape(-1).tolist() if ids is not None else [],
        logprobs=arr("output_logprobs"), top_ids=arr("top_logprob_ids"),
        top_logprobs=arr("top_logprobs"),
        hidden=hidden.astype(np.float32, copy=False) if hidden is not None else None,
        prompt_logprobs=arr("prompt_token_logprobs"), prompt_top_ids=arr("prompt_top_logprob_ids"),
        prompt_top_logprobs=arr("prompt_top_logprobs"),
        finish_reason=reason.decode() if reason is not None else None,
        num_input_tokens=int(n_in) if n_in is not None else None,
        num_output_tokens=int(n_out) if n_out is not None else None,
    )


class TritonBackend:
    def __init__(self, url: str, model: str = "llm"):
        import tritonclient.grpc.aio as grpcaio

        self._aio = grpcaio
        self.url, self.model = url, model
        self.client = grpcaio.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return await self.client.is_model_ready(self.model)
        except Exception:  # noqa: BLE001 - not reachable yet: not ready
            return False

    def _inputs(self, ids: list[int], settings: dict, stream: bool) -> list:
        aio = self._aio
        arrays = (("input_ids", np.asarray(ids, np.int32), "INT32"),
                  ("stream", np.asarray([stream]), "BOOL"),
                  ("exclude_input_in_output", np.asarray([True]), "BOOL"),
                  ("sampling_parameters", np.asarray([json.dumps(settings).encode()],
                                                     np.object_), "BYTES"))
        out = []
        for name, value, dtype in arrays:
            inp = aio.InferInput(name, list(value.shape), dtype)
            inp.set_data_from_numpy(value)
            out.append(inp)
        return out

    async def generate(self, request_id: str, ids: list[int], settings: dict, stream: bool,
                       n: int) -> AsyncIterator[Piece]:
        """The request's Pieces in arrival order, until each of its n completions finished;
        BackendError for Triton's error."""
        sent_all = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": self._inputs(ids, settings, stream),
                   "request_id": request_id}
            await sent_all.wait()  # NOTE: the stream stays open until every response came

        call = self.client.stream_infer(requests())
        finished = 0
        try:
            async for result, error in call:
                if error is not None:
                    raise BackendError(str(error))
                piece = _piece(result)
                finished += piece.finish_reason is not None
                yield piece
                if finished >= n:
                    return
        finally:
            sent_all.set()
            if finished < n:
                call.cancel()

    async def close(self) -> None:
        await self.client.close()
