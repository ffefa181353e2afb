"""Sequence: the engine's running state of one completion of a request (a plain object: token ids,
status, block table and counters; its hidden rows are kept by hidden_rows.HiddenRows)."""

from __future__ import annotations

import enum
from collections import deque

from hsserve.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from hsserve.request import FinishReason, HiddenStatesMode, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SampleGroup:
    """The n completions of one request (n = 1 for most): one sink, done when all have finished."""

    def __init__(self, n: int):
        self.n = n
        self.seqs: list[Sequence] = []
        self.num_finished = 0

    @property
    def done(self) -> bool:
        return self.num_finished == self.n


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        seed: int,
        hidden_mode: HiddenStatesMode,
        hidden_layers: tuple[int, ...],
        detokenizer: IncrementalDetokenizer,
        sink,
        arrival: int,
        max_num_tokens: int,
        group: SampleGroup | None = None,
    ):
        self.request_id = request_id
        self.group = group or SampleGroup(1)
        self.index = len(self.group.seqs)  # sequence_index of this completion
        self.group.seqs.append(self)
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.sampling = sampling
        self.seed = seed
        self.hidden_mode = hidden_mode
        self.hidden_layers = hidden_layers  # normalized 0..L, in the order requested
        self.detokenizer = detokenizer
        self.stop = StopMatcher(sampling.stop)
        self.sink = sink
        self.arrival = arrival
        self.status = Status.WAITING
        self.t_submit = 0.0  # engine clock (monotonic) at submit
        self.t_last = 0.0  # when its last token came (the submit time before the first)
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose K/V is in the cache
        self.block_hashes: list[bytes] = []  # chain hashes of full blocks of token_ids
        self.num_registered = 0  # tokens whose blocks are indexed in the prefix cache
        self.num_cached_tokens: int | None = None  # prompt tokens found cached at admission
        # NOTE: finish_reason set while status is RUNNING means "decided, but the last token's
        # hidden row is still to be computed" (one more forward without sampling).
        self.finish_reason: FinishReason | None = None
        self.num_tokens_sent = 0  # generated tokens already published
        self.max_num_tokens = max_num_tokens  # prompt + max_tokens, within max_model_len
        # NOTE: per generated token when asked for (TokenLogprob), and their running sums
        self.logprobs: list | None = [] if sampling.logprobs is not None else None
        self.logprob_sums: list[float] = []
        # NOTE: prompt logprobs (completion 0 only): per prompt token recorded so far, first None
        self.prompt_logprobs: list | None = (
            [None] if sampling.prompt_logprobs is not None and self.index == 0 else None)
        self.prompt_logprobs_sent = False
        # NOTE: text length (in self.stop.text) after each generated token not yet published,
        # so a delta's text is the text of the delta's own tokens.
        self.text_marks: deque[int] = deque()
        self.grammar = None  # NOTE: guided decoding: its xgrammar matcher (engine/guided.py)
        # NOTE: EAGLE-3: the head's draft and the token count it follows (engine/drafter.py)
        self.proposal: tuple[int, tuple[int, ...]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still to be computed."""
        entries = self.prompt_logprobs
        return entries is not None and len(entries) < self.num_prompt_tokens

    def ends_at(self, num_tokens: int) -> bool:
        """With num_tokens tokens (prompt included) it has reached max_tokens or max_model_len."""
        return num_tokens >= self.max_num_tokens
