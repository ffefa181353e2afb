"""Messages: commands to an engine loop (its inbox, or the engine process's command pipe) and the
engine process's events back; deltas cross the pipe as plain tuples (cheap to pickle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hsserve.engine.admission import AdmittedRequest
from hsserve.engine.engine_info import EngineInfo
from hsserve.engine.stats import EngineSnapshot
from hsserve.request import Delta, FinishReason, TokenLogprob

if TYPE_CHECKING:
    from hsserve.engine.sequence import Sequence

# ---- commands (client -> engine) ---------------------------------------------------------------


@dataclass(frozen=True)
class Add:
    request: AdmittedRequest


@dataclass(frozen=True)
class Enqueued:
    """In-process only (an Engine's inbox): an admitted request's sequences, built on the
    submitting thread."""

    seqs: list[Sequence]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class FailAll:
    message: str


@dataclass(frozen=True)
class ClearCache:
    pass


@dataclass(frozen=True)
class TakeSnapshot:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# ---- events (engine process -> client) ---------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Deltas:
    wire: list[tuple]  # delta_to_wire of each


@dataclass(frozen=True)
class SnapshotTaken:
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class Died:
    message: str


@dataclass(frozen=True)
class Stopped:
    pass


# ---- deltas on the wire ------------------------------------------------------------------------


def delta_to_wire(d: Delta) -> tuple:
    """A Delta as a tuple of plain values (rows as (dtype, shape, raw bytes), in their dtype)."""
    hidden = None
    if d.hidden is not None:
        h = d.hidden.contiguous()
        raw = h.view(-1).view(torch.uint8).numpy()
        hidden = (str(h.dtype).removeprefix("torch."), tuple(h.shape), raw)
    reason = d.finish_reason.value if d.finish_reason is not None else None
    logprobs = [tuple(e) for e in d.logprobs] if d.logprobs is not None else None
    prompt = None if d.prompt_logprobs is None else [
        None if e is None else tuple(e) for e in d.prompt_logprobs]
    return (d.request_id, d.token_ids, d.text, hidden, reason, d.num_input_tokens,
            d.num_output_tokens, d.error, d.sequence_index, d.request_done, logprobs,
            d.cumulative_logprob, prompt)


def delta_from_wire(w: tuple) -> Delta:
    rid, tokens, text, hidden, reason, n_in, n_out, error, index, done, logprobs, cum, prompt = w
    if hidden is not None:
        dtype, shape, raw = hidden
        hidden = torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)
    if logprobs is not None:
        logprobs = [TokenLogprob(*e) for e in logprobs]
    if prompt is not None:
        prompt = [None if e is None else TokenLogprob(*e) for e in prompt]
    return Delta(rid, tokens, text, hidden, FinishReason(reason) if reason is not None else None,
                 n_in, n_out, error, index, done, logprobs, cum, prompt)


def error_delta(request_id: str, message: str) -> Delta:
    """The one final delta of a request that the engine could not serve."""
    return Delta(request_id, [], "", finish_reason=FinishReason.ERROR, error=message,
                 request_done=True)
