"""Admission: a request is checked against the server's limits once, on the submitting thread
(Triton's execute), so a bad request is refused before it reaches the engine loop or process;
every refusal is a RequestError naming the input and what is allowed.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from hsserve.engine.config import EngineConfig
from hsserve.engine.detokenizer import IncrementalDetokenizer
from hsserve.engine.engine_info import EngineInfo
from hsserve.engine.guided import Grammars
from hsserve.request import (
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    HiddenStatesMode,
    RequestError,
    SamplingParams,
)
from hsserve.engine.sampler import sample_seed
from hsserve.engine.sequence import SampleGroup, Sequence


@dataclass(frozen=True)
class AdmittedRequest:
    """A request that passed admission: tokenized, checked, MODE and layers normalized (0..L),
    its seed drawn. What the engine loop (or the engine process) receives."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int
    hidden_mode: HiddenStatesMode
    hidden_layers: tuple[int, ...]


def make_sequences(req: AdmittedRequest, tokenizer, max_model_len: int, sink,
                   grammars: Grammars | None = None) -> list[Sequence]:
    """The n Sequences of an admitted request, one per completion (each guided one with its own
    grammar matcher)."""
    sp, ids = req.sampling, req.prompt_ids
    group = SampleGroup(sp.n)
    limit = min(len(ids) + sp.max_tokens, max_model_len)
    for i in range(sp.n):
        detok = IncrementalDetokenizer(tokenizer, ids) if tokenizer is not None else None
        seq = Sequence(req.request_id, ids, sp, sample_seed(req.seed, i), req.hidden_mode,
                       req.hidden_layers, detok, sink, arrival=0, max_num_tokens=limit,
                       group=group)
        if sp.guided is not None:
            seq.grammar = grammars.matcher(sp.guided)
        if sp.max_tokens == 0:
            seq.finish_reason = FinishReason.LENGTH  # NOTE: prompt only: no token is sampled
    return group.seqs


class Admission:
    def __init__(self, config: EngineConfig, info: EngineInfo):
        self.spec, self.tokenizer = info.spec, info.tokenizer
        self.max_model_len, self.max_prompt_tokens = info.max_model_len, info.max_prompt_tokens
        self.max_tokens_limit = config.max_tokens_limit
        self.max_n = config.max_num_seqs
        self.max_logprobs = config.max_logprobs
        self.ceiling = config.hidden_states_ceiling
        self.captured_layers = info.captured_layers
        self._rng = random.Random()  # NOTE: seeds for unseeded requests
        self.grammars = Grammars(info.tokenizer, info.spec.vocab_size, info.spec.eos_token_ids)

    def prompt_ids(self, request: GenerationRequest) -> tuple[list[int], str]:
        if (request.prompt is None) == (request.prompt_ids is None):
            raise RequestError("text_input", "give exactly one of text_input or input_ids")
        if request.prompt is not None:
            if self.tokenizer is None:
                raise RequestError("text_input", "this model has no tokenizer; send input_ids")
            return list(self.tokenizer(request.prompt).input_ids), "text_input"
        ids = [int(t) for t in request.prompt_ids]
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(
                "input_ids", f"token id {bad[0]} outside the vocabulary 0..{self.spec.vocab_size - 1}"
            )
        return ids, "input_ids"

    def check(self, request: GenerationRequest) -> tuple[list[int], HiddenStatesMode, tuple[int, ...]]:
        """Validate `request` (RequestError names the input): its prompt ids, mode and layers
        (normalized)."""
        ids, name = self.prompt_ids(request)
        sp = request.sampling
        if not ids:
            raise RequestError(name, "the prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(
                name, f"the prompt has {len(ids)} tokens; max_prompt_tokens is {self.max_prompt_tokens}"
            )
        sp.validate(self.max_tokens_limit, self.max_n, self.max_logprobs)
        if sp.guided is not None:
            self.grammars.compile(sp.guided)  # NOTE: refused here when invalid; cached for the loop
        if len(ids) + (1 if sp.max_tokens else 0) > self.max_model_len:
            raise RequestError(
                name,
                f"the prompt has {len(ids)} tokens; with max_tokens={sp.max_tokens} it must leave "
                f"room within max_model_len={self.max_model_len}",
            )
        mode = HiddenStatesMode.parse(request.hidden_mode)  # NOTE: the one parse of MODE
        ceiling = self.ceiling
        if mode > ceiling:
            allowed = ", ".join(m.label for m in HiddenStatesMode if m <= ceiling)
            raise RequestError(
                "MODE", f"{mode.label!r} is above this server's ceiling {ceiling.label!r}; allowed: {allowed}"
            )
        given = request.hidden_layers
        if given is not None and not len(given):
            raise RequestError("hidden_layers", "empty; give at least one layer index")
        if given is None:
            # NOTE: MODE none asks for no layer: never the default, which may not be captured
            return ids, mode, () if mode == HiddenStatesMode.NONE else (self.normalize_layer(-1),)
        layers = tuple(self.normalize_layer(k) for k in given)  # NOTE: checked whatever MODE is
        if mode == HiddenStatesMode.NONE:
            raise RequestError("hidden_layers", f"{list(given)} given while MODE is none; "
                               "set MODE to last or full to get hidden states")
        return ids, mode, layers

    def admit(self, request: GenerationRequest) -> AdmittedRequest:
        """Validate `request` (RequestError names the input) and settle what the engine needs."""
        ids, mode, layers = self.check(request)
        sp = request.sampling
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(64)
        return AdmittedRequest(request.request_id, ids, sp, seed, mode, layers)

    def normalize_layer(self, k: int) -> int:
        n = self.spec.num_layers
        allowed = f"captured layers {list(self.captured_layers)} (or the same counted from the end)"
        if not -(n + 1) <= k <= n:
            raise RequestError("hidden_layers", f"layer {k} outside -{n + 1}..{n}; {allowed}")
        k = self.spec.normalize_layer(k)
        if k not in self.captured_layers:
            raise RequestError("hidden_layers", f"layer {k} is not captured by this server; {allowed}")
        return k


class RequestIds:
    """The request ids in flight, at most max_num_seqs + max_queue_size. Callers hold `lock`
    around claim/release and whatever must happen atomically with them."""

    def __init__(self, config: EngineConfig):
        self.lock = threading.Lock()
        self._ids: set[str] = set()
        self._config = config

    def claim(self, request_id: str, closed: bool = False) -> None:
        """Raises RequestError for an id already in flight, EngineUnavailable when full or when
        the engine is `closed` (stopped or dead)."""
        if request_id in self._ids:
            raise RequestError("request_id", f"{request_id!r} is already in flight")
        limit = self._config.max_num_seqs + self._config.max_queue_size
        if len(self._ids) >= limit:
            raise EngineUnavailable(
                f"the queue is full: {len(self._ids)} requests in flight (max_num_seqs "
                f"{self._config.max_num_seqs} + max_queue_size {self._config.max_queue_size}); "
                "retry later"
            )
        if closed:
            raise EngineUnavailable("the engine is not serving")
        self._ids.add(request_id)

    def release(self, request_id: str) -> None:
        self._ids.discard(request_id)

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self):
        return iter(list(self._ids))


def not_serving(error: BaseException | None, dead: bool) -> EngineUnavailable:
    """The refusal of an engine that is not serving, naming why when its loop died."""
    why = f": {error!r}" if error is not None and dead else ""
    return EngineUnavailable(f"the engine is not serving{why}")
