"""Pieces -> OpenAI objects: completion and chat choices (whole or as stream chunks), their
logprobs in each endpoint's format, usage, and the hidden_states extension.

hidden_states of a choice: {"mode", "layers", "shape": [rows, features], "dtype": "float32",
"data": base64 of little-endian float32 (or nested lists with encoding_format "float")}; the
features are the asked layers' rows concatenated in the asked order (the `llm` model's
HIDDEN_STATES). Streamed, each chunk carries the rows of the tokens it carries.
"""

from __future__ import annotations

import base64
import math

import numpy as np

from hsserve.gateway.backend import Piece
from hsserve.gateway.params import Generation, HiddenSpec
from hsserve.gateway.prompts import Prompts


class Choice:
    """One completion gathered from its Pieces (non-streamed answers, and usage)."""

    def __init__(self):
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.hidden: list[np.ndarray] = []
        self.finish_reason: str | None = None
        self.num_output_tokens = 0

    def add(self, p: Piece) -> None:
        self.text.append(p.text)
        self.ids += p.token_ids
        if p.logprobs is not None:
            self.logprobs += p.logprobs.reshape(-1).tolist()
            self.top += token_tops(p.top_ids, p.top_logprobs, len(p.token_ids))
        if p.hidden is not None:
            self.hidden.append(p.hidden)
        if p.finish_reason is not None:
            self.finish_reason = finish(p.finish_reason)
            self.num_output_tokens = p.num_output_tokens or len(self.ids)


def finish(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def token_tops(ids, lps, tokens: int) -> list[list[tuple[int, float]]]:
    """[tokens, k] ids / logprobs -> per token [(id, logprob)] (k = 0: empty lists)."""
    if ids is None or lps is None:
        return [[] for _ in range(tokens)]
    return [[(int(i), float(v)) for i, v in zip(row_i, row_v) if i >= 0]
            for row_i, row_v in zip(ids.reshape(tokens, -1), lps.reshape(tokens, -1))]


def prompt_entries(p: Piece, k: int) -> tuple[list, list]:
    """The prompt's logprobs (None first) and its top alternatives (None first)."""
    lps = [None if math.isnan(v) else float(v) for v in p.prompt_logprobs.reshape(-1).tolist()]
    count = len(lps)
    tops = token_tops(p.prompt_top_ids, p.prompt_top_logprobs, count) if k else \
        [[] for _ in range(count)]
    return lps, [None] + tops[1:]


def completion_logprobs(prompts: Prompts, ids: list[int], lps: list, tops: list,
                        offset: int = 0) -> dict:
    """The completions format: tokens, token_logprobs, top_logprobs (each a {token: logprob}
    holding the chosen token too, as OpenAI's), text_offset."""
    tokens, offsets, top_dicts = [], [], []
    for tid, lp, top in zip(ids, lps, tops):
        text = prompts.token_text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if top is None:
            top_dicts.append(None)
            continue
        d = {prompts.token_text(i): v for i, v in top}
        if lp is not None:
            d.setdefault(text, lp)
        top_dicts.append(d)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts,
            "text_offset": offsets}


def chat_logprobs(prompts: Prompts, ids: list[int], lps: list, tops: list) -> dict:
    def entry(tid: int, lp: float) -> dict:
        text = prompts.token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, lp, top in zip(ids, lps, tops)]}


def hidden_json(spec: HiddenSpec, rows: list[np.ndarray]) -> dict:
    arr = np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)
    arr = np.ascontiguousarray(arr, dtype="<f4")
    data = arr.tolist() if spec.encoding == "float" else base64.b64encode(arr.tobytes()).decode()
    return {"mode": spec.mode, "layers": list(spec.layers) if spec.layers else [-1],
            "shape": list(arr.shape), "dtype": "float32", "data": data}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_of(gen: Generation, prompts: Prompts, ids, lps, tops, offset: int = 0):
    if gen.logprobs is None:
        return None
    if gen.chat:
        return chat_logprobs(prompts, ids, lps, tops)
    return completion_logprobs(prompts, ids, lps, tops, offset)


def choice_json(gen: Generation, prompts: Prompts, index: int, c: Choice,
                echo: tuple | None = None) -> dict:
    """A whole choice; echo: (prompt text, ids, logprobs, tops) to put first (completions)."""
    text = "".join(c.text)
    ids, lps, tops = c.ids, c.logprobs, c.top
    if echo is not None:
        text = echo[0] + text
        ids, lps, tops = echo[1] + ids, echo[2] + lps, echo[3] + tops
    out: dict = {"index": index}
    if gen.chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    out["logprobs"] = logprobs_of(gen, prompts, ids, lps, tops)
    out["finish_reason"] = c.finish_reason
    if gen.hidden is not None:
        out["hidden_states"] = hidden_json(gen.hidden, c.hidden)
    return out


def chunk_choice(gen: Generation, prompts: Prompts, index: int, p: Piece, first: bool,
                 echo: tuple | None = None, offset: int = 0) -> dict:
    """One streamed piece of a choice (the first carries the role, or the echoed prompt);
    offset: the choice's text length so far (text_offset)."""
    text, ids = p.text, p.token_ids
    lps = p.logprobs.reshape(-1).tolist() if p.logprobs is not None else []
    tops = token_tops(p.top_ids, p.top_logprobs, len(ids)) if p.logprobs is not None else []
    if echo is not None:
        text, ids, lps, tops = echo[0] + text, echo[1] + ids, echo[2] + lps, echo[3] + tops
    out: dict = {"index": index}
    if gen.chat:
        out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        out["text"] = text
    out["logprobs"] = logprobs_of(gen, prompts, ids, lps, tops, offset)
    out["finish_reason"] = finish(p.finish_reason) if p.finish_reason else None
    if gen.hidden is not None and p.hidden is not None:
        out["hidden_states"] = hidden_json(gen.hidden, [p.hidden])
    return out
