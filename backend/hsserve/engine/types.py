"""What the scheduler, the executor and the loop hand each other: a step's chunks, the step as
launched on the device, and what it produced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hsserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from hsserve.engine.step_rows import RowPlan, StepRows
    from hsserve.engine.logprobs import PromptLogprobs, StepLogprobs
    from hsserve.models.hidden_capture import HiddenCapture


@dataclass(slots=True)
class Chunk:
    """Compute K/V (and rows) for the tokens at positions start..start + num_tokens - 1 this step
    (seq.token_ids[start:end]; for a chunk queued ahead, the one token is still on the device)."""

    seq: Sequence
    start: int
    num_tokens: int
    # NOTE: queued ahead: before the previous step was read, so its one input token is that
    # step's sample, still on the device (start == seq.num_tokens when queued)
    ahead: bool = False
    last_input: bool = False  # ahead: that token is the sequence's last by length, so no sample
    # NOTE: speculative decoding: proposed tokens after the sequence's last, verified this step
    # (num_tokens counts them; each of the chunk's rows samples a target token)
    draft: tuple[int, ...] = ()
    # NOTE: prompt logprobs: (lo, hi, k): positions lo..hi-1, whose logits give prompt tokens
    # lo+1..hi theirs, with k alternatives
    prompt_span: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the last known token of the sequence."""
        return self.end - len(self.draft) == self.seq.num_tokens

    @property
    def num_samples(self) -> int:
        """Target tokens this chunk samples when it samples: one, or one per row of a draft's."""
        return 1 + len(self.draft)

    def input_ids(self) -> list[int]:
        """The chunk's input tokens (not for a chunk queued ahead): known ones, then its draft."""
        ids = self.seq.token_ids[self.start : self.end - len(self.draft)]
        return ids + list(self.draft) if self.draft else ids

    @property
    def samples(self) -> bool:
        if self.ahead:
            return not self.last_input and self.seq.finish_reason is None
        return self.completes and self.seq.finish_reason is None


@dataclass
class Launched:
    """A step queued on the device whose results have not been read."""

    chunks: list[Chunk]
    sampled: list[bool]  # per chunk: a token was sampled (decided at launch)
    tokens: torch.Tensor | None  # host copy of the samples, one per sampling chunk
    rows: StepRows | None  # the rows that leave the device
    plan: RowPlan | None  # which rows of which chunk they are
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)
    logprobs: StepLogprobs | None = None  # host copies, for the rows that asked
    prompt: list[PromptLogprobs] | None = None  # prompt logprobs of the chunks with a span
    # NOTE: sampling left for after the previous step is read (a guided step queued ahead)
    pending: tuple | None = None
    # NOTE: EAGLE-3: every row's target layers the draft head reads (engine/drafter.py)
    aux: HiddenCapture | None = None
