"""What a client asks for (GenerationRequest, SamplingParams) and what the engine answers (Delta)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class RequestError(ValueError):
    """A request the engine refuses; `input_name` names the offending input (SPEC.md errors)."""

    def __init__(self, input_name: str, message: str):
        super().__init__(f"{input_name}: {message}")
        self.input_name = input_name


class EngineUnavailable(RuntimeError):
    """The engine cannot take a request now (queue full, stopping, or its loop died): retry later
    or elsewhere; Triton answers UNAVAILABLE."""


class HiddenStatesMode(enum.IntEnum):
    """Ordered so that a request mode is allowed iff mode <= server ceiling."""

    NONE = 0
    LAST = 1
    FULL = 2

    @classmethod
    def parse(cls, value: str | HiddenStatesMode, input_name: str = "MODE") -> HiddenStatesMode:
        if isinstance(value, HiddenStatesMode):
            return value
        try:
            return cls[str(value).strip().upper()]
        except KeyError:
            raise RequestError(
                input_name, f"unknown value {value!r}; allowed: 'none', 'last', 'full'"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GuidedDecoding:
    """Structured output: the text must match a JSON schema, a regex, one of the choices, an EBNF
    grammar or any JSON object (vLLM's `guided_decoding` names). `value` is the schema as JSON
    (its key order kept), the regex or grammar, the choices as a JSON list, or "" for
    json_object."""

    kind: str
    value: str

    @classmethod
    def parse(cls, name: str, raw) -> GuidedDecoding:
        """From the request's JSON object (or its text); RequestError names the field."""
        if isinstance(raw, (str, bytes)):
            raw = _json_text(name, raw)
        if not isinstance(raw, dict):
            raise RequestError(name, f"must be an object with one of {list(GUIDED_KINDS)}")
        unknown = sorted(set(raw) - set(GUIDED_KINDS) - {"backend"})
        if unknown:
            raise RequestError(name, f"unknown field(s) {unknown}; allowed: {list(GUIDED_KINDS)}")
        if raw.get("backend") not in (None, "auto", "xgrammar"):
            raise RequestError(f"{name}.backend", f"{raw['backend']!r}; allowed: 'xgrammar'")
        given = [k for k in GUIDED_KINDS if raw.get(k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(name, f"give exactly one of {list(GUIDED_KINDS)}, got {given}")
        kind = given[0]
        return cls(kind, _guided_value(f"{name}.{kind}", kind, raw[kind]))


def _json_text(name: str, text):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(name, f"is not valid JSON: {e.msg}") from None


def _guided_value(name: str, kind: str, v) -> str:
    if kind == "json_object":
        if v is not True:
            raise RequestError(name, "must be true")
        return ""
    if kind == "json":
        if isinstance(v, str):
            v = _json_text(name, v)
        if not isinstance(v, (dict, bool)):
            raise RequestError(name, "must be a JSON schema (an object)")
        return json.dumps(v)  # NOTE: key order kept: it is the order properties are generated in
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) and c for c in v)):
            raise RequestError(name, "must be a non-empty list of non-empty strings")
        return json.dumps(v)
    if not isinstance(v, str) or not v.strip():
        raise RequestError(name, "must be a non-empty string")
    return v


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # NOTE: no stop (EOS, stop ids or strings) before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # NOTE: 0 (or -1) means no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # NOTE: top alternatives per token (0: the token's own); None: off
    # NOTE: the prompt's per-token log-probabilities (the same k), answered once; None: off
    prompt_logprobs: int | None = None
    guided: GuidedDecoding | None = None  # NOTE: compiled and enforced by engine/guided.py

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, max_tokens_limit: int, max_n: int = 1, max_logprobs: int = 20) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise RequestError("logprobs", f"{self.logprobs} is outside 0..{max_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= max_logprobs:
            raise RequestError("prompt_logprobs",
                               f"{self.prompt_logprobs} is outside 0..{max_logprobs}")
        if not 0 <= self.max_tokens <= max_tokens_limit:
            raise RequestError(
                "max_tokens", f"{self.max_tokens} is outside the allowed range 0..{max_tokens_limit}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                "min_tokens", f"{self.min_tokens} must be in 0..max_tokens ({self.max_tokens})"
            )
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise RequestError("temperature", f"{self.temperature} must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p", f"{self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise RequestError("top_k", f"{self.top_k} must be -1, 0 (disabled) or >= 1")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise RequestError("seed", f"{self.seed} must be in 0..2**64-1")
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop strings must be non-empty")
        if not 1 <= self.n <= max_n:
            raise RequestError("n", f"{self.n} is outside the allowed range 1..{max_n}")
        if self.guided is not None and (self.min_tokens or self.ignore_eos):
            # NOTE: the grammar decides where the text ends; EOS is its last token
            raise RequestError("min_tokens" if self.min_tokens else "ignore_eos",
                               "cannot be combined with guided_decoding")


@dataclass
class GenerationRequest:
    """One prompt to run. Exactly one of `prompt` (text) or `prompt_ids` is given."""

    request_id: str
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    hidden_mode: HiddenStatesMode | str = HiddenStatesMode.NONE  # NOTE: parsed by admission
    hidden_layers: tuple[int, ...] | None = None  # NOTE: None: [-1] when MODE asks for rows


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model (log-softmax of its logits, before
    temperature, top-k / top-p or min_tokens), its rank among all tokens (1 = the most likely),
    and the k most likely tokens with theirs."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Delta:
    """What one engine step produced for one request; the last one has `finish_reason` set.

    `hidden` holds the rows of this delta's tokens ([rows, hidden_size * len(layers)], float32 on
    the CPU), None when the request asked for none. In full mode the first delta also carries
    the prompt rows; in last mode the final delta carries the single row.
    """

    request_id: str
    token_ids: list[int]
    text: str
    hidden: torch.Tensor | None = None
    finish_reason: FinishReason | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    sequence_index: int = 0
    request_done: bool = False  # the last delta of the request (of all its n completions)
    logprobs: list[TokenLogprob] | None = None  # per token of this delta, when asked for
    cumulative_logprob: float | None = None  # the completion's, up to this delta's last token
    # NOTE: per prompt token (the first None), once: in completion 0's first delta that has tokens
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        """The last delta of this completion (sequence_index)."""
        return self.finish_reason is not None

    @classmethod
    def merge(cls, deltas: list[Delta]) -> Delta:
        """Consecutive deltas of one completion as one (their tokens, text and rows joined)."""
        if len(deltas) == 1:
            return deltas[0]
        rows = [d.hidden for d in deltas if d.hidden is not None]
        last = deltas[-1]
        logprobs = [e for d in deltas for e in d.logprobs or ()] if last.logprobs is not None \
            else None
        return cls(
            request_id=last.request_id,
            token_ids=[t for d in deltas for t in d.token_ids],
            text="".join(d.text for d in deltas),
            hidden=torch.cat(rows) if rows else None,
            finish_reason=last.finish_reason,
            num_input_tokens=last.num_input_tokens,
            num_output_tokens=last.num_output_tokens,
            error=last.error,
            sequence_index=last.sequence_index,
            request_done=last.request_done,
            logprobs=logprobs,
            cumulative_logprob=last.cumulative_logprob,
            prompt_logprobs=next((d.prompt_logprobs for d in deltas
                                  if d.prompt_logprobs is not None), None),
        )
