"""The HTTP routes: /v1/models, /v1/completions, /v1/chat/completions (whole answers and SSE
streams ending in `data: [DONE]`), /health.

A request's prompts each get a Triton stream; a streamed answer starts only after every stream's
first response, so a request the engine refuses is a 400 naming the field, never a broken
stream. A client that leaves early (a stream, or the wait for a whole answer) cancels its Triton
requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hsserve.gateway import params, render
from hsserve.gateway.backend import BackendError, Piece, TritonBackend
from hsserve.gateway.errors import ApiError, from_backend
from hsserve.gateway.params import Generation
from hsserve.gateway.prompts import Prompts

_WATCH_S = 0.5  # NOTE: how often a whole answer in progress checks that its client is still there


@dataclass
class Job:
    """One prompt of a request: its Triton stream and what its choices echo."""
    index: int
    text: str
    ids: list[int]
    pieces: object = None  # the backend's async iterator
    echo_lps: tuple | None = None  # (logprobs, tops) of the prompt, once they arrived
    waiting: list = field(default_factory=list)  # echoed choices held until echo_lps came

    def note_prompt(self, p: Piece, k: int) -> None:
        """Keep the prompt's logprobs (k alternatives) when this piece carries them."""
        if p.prompt_logprobs is not None and self.echo_lps is None:
            self.echo_lps = render.prompt_entries(p, k)

    def echo(self) -> tuple:
        """(text, ids, logprobs, tops) of the prompt, for an echoed choice."""
        lps, tops = self.echo_lps or ([None] * len(self.ids), [None] * len(self.ids))
        return self.text, list(self.ids), list(lps), list(tops)


def _chunk(rid: str, gen: Generation, created: int, choices: list, **extra) -> str:
    obj = "chat.completion.chunk" if gen.chat else "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": gen.model,
            "choices": choices, **extra}
    return f"data: {json.dumps(body)}\n\n"


class Gateway:
    def __init__(self, backend: TritonBackend, prompts: Prompts, names: list[str]):
        self.backend, self.prompts, self.names = backend, prompts, names
        self.created = int(time.time())

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": self.created,
                                            "owned_by": "hsserve"} for n in self.names]}

    def jobs(self, gen: Generation) -> tuple[str, list[Job]]:
        """The answer's id and its prompts' Jobs, each with its Triton stream opened."""
        if gen.model not in self.names:
            raise ApiError(f"model: {gen.model!r} does not exist; served: {self.names}",
                           param="model", status=404, code="model_not_found")
        if gen.chat:
            out = [Job(0, "", self.prompts.chat_ids(gen.prompts))]
        else:
            out = []
            for i, p in enumerate(gen.prompts):
                ids = self.prompts.ids(p)
                text = p if isinstance(p, str) else (self.prompts.text(ids) if gen.echo else "")
                out.append(Job(i, text, ids))
        rid = ("chatcmpl-" if gen.chat else "cmpl-") + uuid.uuid4().hex
        for job in out:
            job.pieces = self.backend.generate(f"{rid}-{job.index}", job.ids, gen.settings,
                                               gen.stream, gen.n).__aiter__()
        return rid, out

    async def answer(self, gen: Generation) -> dict:
        rid, jobs = self.jobs(gen)
        gathered = await asyncio.gather(*[self._collect(gen, j) for j in jobs],
                                        return_exceptions=True)
        for g in gathered:
            if isinstance(g, BaseException):
                raise from_backend(str(g), gen.rename) if isinstance(g, BackendError) else g
        choices, completion = [], 0
        for job, chosen in zip(jobs, gathered):
            for j, c in enumerate(chosen):
                echo = job.echo() if gen.echo else None
                choices.append(render.choice_json(gen, self.prompts, job.index * gen.n + j, c,
                                                  echo))
                completion += c.num_output_tokens
        return {"id": rid, "object": "chat.completion" if gen.chat else "text_completion",
                "created": int(time.time()), "model": gen.model, "choices": choices,
                "usage": render.usage(sum(len(j.ids) for j in jobs), completion)}

    async def _collect(self, gen: Generation, job: Job) -> list[render.Choice]:
        choices = [render.Choice() for _ in range(gen.n)]
        async for p in job.pieces:
            job.note_prompt(p, gen.logprobs or 0)
            choices[p.index].add(p)
        return choices

    async def start_stream(self, gen: Generation):
        """The SSE body's iterator, after every prompt's first response (errors raised here)."""
        rid, jobs = self.jobs(gen)
        firsts = await asyncio.gather(*[j.pieces.__anext__() for j in jobs],
                                      return_exceptions=True)
        bad = next((f for f in firsts if isinstance(f, BaseException)), None)
        if bad is not None:
            await asyncio.gather(*[j.pieces.aclose() for j in jobs], return_exceptions=True)
            if isinstance(bad, StopAsyncIteration):
                raise ApiError("the server ended the stream without a response", status=500,
                               kind="server_error")
            raise from_backend(str(bad), gen.rename) if isinstance(bad, BackendError) else bad
        return self._sse(gen, rid, jobs, firsts)

    async def _sse(self, gen: Generation, rid: str, jobs: list[Job], firsts: list[Piece]):
        stream = _Stream(self.prompts, gen, rid)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async for p in job.pieces:
                    queue.put_nowait((job, p))
            except Exception as e:  # noqa: BLE001 - reported in the stream
                queue.put_nowait((job, e))
            finally:
                queue.put_nowait((job, None))
                await job.pieces.aclose()

        tasks = [asyncio.create_task(pump(j)) for j in jobs]
        try:
            for job, p in zip(jobs, firsts):
                for line in stream.emit(job, p):
                    yield line
            live = len(jobs)
            while live:
                job, item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, Exception):
                    err = from_backend(str(item), gen.rename) if isinstance(
                        item, BackendError) else ApiError(str(item), status=500)
                    yield f"data: {json.dumps(err.body())}\n\n"
                    return
                else:
                    for line in stream.emit(job, item):
                        yield line
            if gen.include_usage:
                yield _chunk(rid, gen, stream.created, [], usage=render.usage(
                    sum(len(j.ids) for j in jobs), stream.completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()


class _Stream:
    """A streamed answer's state: which choices started, their text offsets, token counts."""

    def __init__(self, prompts: Prompts, gen: Generation, rid: str):
        self.prompts, self.gen, self.rid = prompts, gen, rid
        self.created = int(time.time())
        self.started: set[tuple[int, int]] = set()
        self.offsets: dict[tuple[int, int], int] = {}
        self.completion_tokens = 0

    def emit(self, job: Job, p: Piece) -> list[str]:
        gen = self.gen
        job.note_prompt(p, gen.logprobs or 0)
        if gen.echo and gen.logprobs is not None and job.echo_lps is None:
            job.waiting.append(p)  # NOTE: n > 1: a choice came before the prompt's logprobs
            return []
        held, job.waiting = job.waiting, []
        return [line for q in held + [p] for line in self._one(job, q)]

    def _one(self, job: Job, p: Piece) -> list[str]:
        key = (job.index, p.index)
        first = key not in self.started
        self.started.add(key)
        echo = job.echo() if first and self.gen.echo else None
        offset = self.offsets.get(key, 0)
        choice = render.chunk_choice(self.gen, self.prompts, job.index * self.gen.n + p.index,
                                     p, first, echo, offset)
        self.offsets[key] = offset + len(p.text) + (len(echo[0]) if echo else 0)
        if p.finish_reason is not None:
            self.completion_tokens += p.num_output_tokens or 0
        return [_chunk(self.rid, self.gen, self.created, [choice])]


def create_app(gw: Gateway):
    """The FastAPI application over a Gateway."""
    app = FastAPI(title="hsserve OpenAI API", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("the body must be a JSON object")
        return body

    async def run(gen: Generation, request: Request):
        if gen.stream:
            lines = await gw.start_stream(gen)
            return StreamingResponse(lines, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answer = asyncio.ensure_future(gw.answer(gen))
        while not (await asyncio.wait({answer}, timeout=_WATCH_S))[0]:
            if await request.is_disconnected():  # NOTE: cancelling ends its Triton requests
                answer.cancel()
                return JSONResponse(ApiError("the client disconnected", status=499,
                                             kind="cancelled").body(), status_code=499)
        return JSONResponse(answer.result())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(params.completion(await body_of(request)), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(params.chat(await body_of(request)), request)

    @app.get("/v1/models")
    async def models():
        return gw.models()

    @app.get("/health")
    async def health():
        ok = await gw.backend.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    return app
