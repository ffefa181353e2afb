"""Outputs: what a completed step means for its sequences (tokens appended, stop and length
checks, rows recorded, sequences finished) and the deltas published to each request's sink."""

from __future__ import annotations

import logging
from typing import Callable

from hsserve.engine.hidden_rows import HiddenRows, wants_final_row
from hsserve.engine.logprobs import prompt_entries, token_logprobs
from hsserve.engine.scheduler import Scheduler
from hsserve.engine.guided import advance
from hsserve.engine.sequence import Sequence, Status
from hsserve.engine.speculative import accepted_length
from hsserve.engine.stats import EngineStats
from hsserve.engine.types import Launched
from hsserve.request import Delta, FinishReason, TokenLogprob

log = logging.getLogger(__name__)


def awaits_compute(seq: Sequence) -> bool:
    """A sequence whose end is decided still needs a step: its final row, or prompt logprobs."""
    return wants_final_row(seq) or seq.awaits_prompt_logprobs


class Outputs:
    def __init__(self, scheduler: Scheduler, rows: HiddenRows, stats: EngineStats,
                 eos_ids: frozenset[int], on_request_done: Callable[[str], None]):
        self.scheduler, self.rows, self.stats = scheduler, rows, stats
        self.eos_ids = eos_ids
        self._on_request_done = on_request_done

    def process(self, step: Launched, tokens: list) -> None:
        """A completed step's tokens (per chunk: None where none was sampled, a list for a chunk
        with a draft) and rows."""
        num_rows = sum(c.num_samples for c, f in zip(step.chunks, step.sampled) if f)
        logprobs, at = token_logprobs(step.logprobs, num_rows), 0
        prompt = {p.chunk: p for p in step.prompt or ()}
        for i, c in enumerate(step.chunks):
            seq = c.seq
            first, at = at, at + (c.num_samples if step.sampled[i] else 0)
            if seq.status is Status.FINISHED:
                continue  # NOTE: stopped or cancelled while this step ran ahead
            if i in prompt and len(seq.prompt_logprobs) == prompt[i].first:
                seq.prompt_logprobs += prompt_entries(prompt[i])
            decided = seq.finish_reason is not None  # NOTE: a sample after the end is void
            token = None if decided else tokens[i]
            if c.draft and token is not None:
                self._verify(seq, c, token, logprobs[first:at])
            else:
                seq.num_computed = c.end
                if token is not None:
                    self._append(seq, token, logprobs[first])
            self.rows.record(step, i, seq.num_computed - c.start)
            self.scheduler.cache_computed(seq)
            if seq.finish_reason is not None and (
                    not awaits_compute(seq) or (c.completes and token is None)):
                self.finish(seq)
            else:
                self.publish(seq, final=False)

    def _verify(self, seq: Sequence, c, targets: list[int], logprobs: list) -> None:
        """A draft's chunk: its drafts up to the first the target disagrees with are accepted,
        then the target's own token there; an end decided on the way drops the rest. The last
        token stays uncomputed, as after any decode (its K/V and row come with the next step)."""
        m = accepted_length(c.draft, targets)
        self.stats.draft_tokens += len(c.draft)
        self.stats.accepted_tokens += m
        for j in range(m + 1):
            self._append(seq, targets[j], logprobs[j])
            if seq.finish_reason is not None:
                break
        seq.num_computed = seq.num_tokens - 1

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
            seq.logprob_sums.append(logprob.logprob + (seq.logprob_sums[-1] if seq.logprob_sums
                                                       else 0.0))
        now = EngineStats.now()
        self.stats.generation_tokens += 1
        (self.stats.ttft if seq.num_generated == 1 else self.stats.itl).append(now - seq.t_last)
        seq.t_last = now
        sp = seq.sampling
        stopped = False
        early = seq.num_generated < sp.min_tokens  # NOTE: no stop before min_tokens
        if seq.detokenizer is not None:
            stopped = seq.stop.feed(seq.detokenizer.add(token), match=not early)
        seq.text_marks.append(len(seq.stop.text))
        if early:
            pass
        elif stopped or token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            seq.finish_reason = FinishReason.STOP
        elif seq.grammar is not None and not advance(seq.grammar, token):
            seq.finish_reason = FinishReason.STOP
        elif seq.ends_at(seq.num_tokens):
            seq.finish_reason = FinishReason.LENGTH

    def publish(self, seq: Sequence, final: bool) -> None:
        """Send what is ready: tokens (with their rows) and their text."""
        p = seq.num_prompt_tokens  # NOTE: slices token_ids once (output_ids would copy them all)
        generated = len(seq.token_ids) - p
        ready = self.rows.tokens_ready(seq, generated, final)
        new = ready - seq.num_tokens_sent
        if new <= 0 and not final:
            return
        tokens = seq.token_ids[p + seq.num_tokens_sent : p + ready]
        if final and seq.detokenizer is not None and not seq.stop.hit:
            seq.stop.text += seq.detokenizer.flush()
        upto = 0
        for _ in range(max(new, 0)):
            upto = seq.text_marks.popleft()
        text = seq.stop.release(upto, final)
        logprobs = cumulative = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[seq.num_tokens_sent : ready]
            cumulative = seq.logprob_sums[ready - 1] if ready else 0.0
        seq.num_tokens_sent = ready
        prompt = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent and (
                not seq.awaits_prompt_logprobs):
            prompt, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        self._send(seq, Delta(
            request_id=seq.request_id, token_ids=tokens, text=text,
            hidden=self.rows.take(seq, final),
            finish_reason=seq.finish_reason if final else None,
            num_input_tokens=p, num_output_tokens=generated,
            sequence_index=seq.index, request_done=final and seq.group.done,
            logprobs=logprobs, cumulative_logprob=cumulative, prompt_logprobs=prompt,
        ))

    def finish(self, seq: Sequence, publish_rest: bool = True, error: str | None = None) -> None:
        """Free the sequence's blocks and send its final delta (the rest of its output, or
        nothing more when cancelled or failed)."""
        self.scheduler.finish(seq)
        seq.group.num_finished += 1
        if seq.group.done:
            self.stats.latency.append(EngineStats.now() - seq.t_submit)
            self._on_request_done(seq.request_id)
        if publish_rest:
            self.publish(seq, final=True)
        else:
            self._send(seq, Delta(
                seq.request_id, [], "", finish_reason=seq.finish_reason,
                num_input_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_tokens_sent,
                error=error, sequence_index=seq.index, request_done=seq.group.done,
            ))
        self.rows.forget(seq)

    def _send(self, seq: Sequence, delta: Delta) -> None:
        try:
            seq.sink(delta)
        except Exception:  # NOTE: a broken sink must not stop the loop
            log.exception("sink of request %s failed", seq.request_id)
