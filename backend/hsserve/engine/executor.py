"""Executor: runs one scheduled batch on the device (mechanism only; policy is the scheduler's,
which rows leave the device is hidden_rows').

Builds the flat token batch and its AttentionBatch, runs the decoder with the layer tap on the
planned rows, computes logits where a token is sampled (a decode graph computes them for every
row), samples. `launch` queues all of that and the copies of its results to the host without
waiting for the device; `complete` waits for them. Between the two the engine may queue the next
step, whose input tokens are this step's samples, still on the device (Chunk.ahead).
"""

from __future__ import annotations

import torch

from hsserve.engine.cuda_graphs import DecodeGraphs
from hsserve.engine.drafter import Eagle3Drafter
from hsserve.engine.step_rows import RowPlan, StepRows
from hsserve.engine.logprobs import PromptLogprobs, prompt_logprobs, step_logprobs
from hsserve.engine.ranks import Ranks
from hsserve.engine.guided import fill_bitmask
from hsserve.engine.sampler import banned_tokens, sample
from hsserve.engine.transfer import download, upload
from hsserve.engine.types import Chunk, Launched
from hsserve.engine.attention_plan import AttentionPlanner
from hsserve.models.decoder import Decoder
from hsserve.models.hidden_capture import HiddenCapture, Taps


def sources_of(chunks: list[Chunk], prev: Launched | None) -> list[int]:
    """Per chunk, for a chunk queued ahead: which of prev's samples is its input token; else -1."""
    if prev is None:
        return [-1] * len(chunks)
    order = [c.seq for c, f in zip(prev.chunks, prev.sampled) if f]
    where = {id(seq): j for j, seq in enumerate(order)}
    return [where[id(c.seq)] if c.ahead else -1 for c in chunks]


class Executor:
    def __init__(self, model: Decoder, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int):
        self.model = model
        self.graphs: DecodeGraphs | None = None  # set by engine setup on CUDA
        self.peers: Ranks | None = None  # NOTE: tensor parallel: the other ranks, told each step
        self.drafter: Eagle3Drafter | None = None  # NOTE: EAGLE-3 (set by engine setup)
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.plan = AttentionPlanner(model.spec, self.device, model.embed.dtype, block_size)
        self.eos_ids = frozenset(model.spec.eos_token_ids)
        self._sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        self.num_graph_steps = 0  # NOTE: steps that replayed a captured graph
        # NOTE: MODE=last rows kept on the device are copied out on this stream, past the steps
        # queued after theirs
        self._fetch_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def sampled(self) -> torch.Tensor:
        """The last step's samples, on the device, where a step queued ahead reads its inputs
        (the decode graphs read them from their own static buffer)."""
        return self.graphs.sampled if self.graphs is not None else self._sampled

    @torch.inference_mode()
    def launch(self, chunks: list[Chunk], plan: RowPlan | None,
               prev: Launched | None = None) -> Launched:
        """Queue one step and the copies of its results (the rows `plan` names); chunks queued
        ahead take their input tokens from prev's samples on the device. Never waits for the
        device on the graph path. Guided rows queued ahead: sampling waits for finish_sampling
        (their masks follow prev's tokens)."""
        sources = sources_of(chunks, prev)
        sampled = [c.samples for c in chunks]
        if self.peers is not None:
            self.peers.send(chunks, sources, sampled, plan is not None and bool(plan.with_rows))
        graph = self._takes_graph(chunks)
        self.num_graph_steps += graph
        aux = None
        if graph:
            logits, block, layers, greedy, prompt, aux = self._forward_graph(chunks, sources,
                                                                             sampled, plan)
        else:
            aux = self.drafter.tap(chunks) if self.drafter is not None else None
            logits, block, layers, greedy, prompt = self._forward_eager(chunks, sources, sampled,
                                                                        plan, aux)
        tokens = logprobs = pending = None
        if logits is not None:
            sampling = [c for c, f in zip(chunks, sampled) if f]
            pending = (logits, sampling, greedy if graph else None, len(sampling) == len(chunks))
            if prev is None or all(c.seq.grammar is None for c in sampling):
                tokens, logprobs = self._tokens(*pending)
                pending = None
        rows = None
        if block is not None:
            if self._fetch_stream is not None and plan.last_only:
                # NOTE: MODE=last only: the rows stay on the device until one is taken
                # (bench/README.md#last-rows-on-device); hidden_rows settles live ones
                rows = StepRows(block, layers, self._fetch_stream, live=graph)
            else:  # NOTE: in the model's dtype (half the bytes of float32)
                rows = StepRows(download(block), layers)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(chunks, sampled, tokens, rows, plan, done, logprobs, prompt, pending, aux)

    def finish_sampling(self, step: Launched) -> None:
        """Sample a step launched with defer (its done event then follows the samples' copy)."""
        if step.pending is None:
            return
        step.tokens, step.logprobs = self._tokens(*step.pending)
        step.pending = None
        if step.done is not None:
            step.done = torch.cuda.Event()
            step.done.record()

    def _takes_graph(self, chunks: list[Chunk]) -> bool:
        """Decode-shaped steps: every chunk one token or a draft's verify (its last token and
        the draft, no rows before), within the graphs' rows."""
        g = self.graphs
        return (g is not None and all(c.num_tokens == c.num_samples for c in chunks)
                and sum(c.num_tokens for c in chunks) <= g.max_batch)

    @torch.inference_mode()
    def follow(self, chunks: list[Chunk], sources: list[int], sampled: list[bool],
               with_rows: bool) -> None:
        """A tensor parallel rank's part of a step rank 0 launched (engine/ranks.py): the same
        forward and collectives; rank 0 samples and takes the rows."""
        if self._takes_graph(chunks):
            self._forward_graph(chunks, sources, sampled, None, with_rows)
        else:
            self._forward_eager(chunks, sources, sampled, None)

    def check_ranks(self, wait_s: float = 0.0) -> None:
        """RankLost when a tensor parallel rank has exited."""
        if self.peers is not None:
            self.peers.check(wait_s)

    def close(self) -> None:
        """Stop the other ranks (tensor parallel)."""
        if self.peers is not None:
            self.peers.close()

    def _tokens(self, logits: torch.Tensor, sampling: list[Chunk], greedy: torch.Tensor | None,
                every_row: bool):
        """The sampling chunks' tokens (host copy, one per logits row: a chunk with a draft has
        one per row) and log-probabilities where asked. greedy: a graph replay's own argmax
        samples (used when every row of it is plainly greedy)."""
        rows = [(c, j) for c in sampling for j in range(c.num_samples)]
        params = [c.seq.sampling for c, _ in rows]
        # NOTE: a row's output index: the token it predicts, counted from the first generated
        steps = [c.end - len(c.draft) + j - c.seq.num_prompt_tokens for c, j in rows]
        banned = None
        if any(p.min_tokens for p in params):  # NOTE: most steps: nobody's min_tokens
            banned = [banned_tokens(p, self.eos_ids, i) for p, i in zip(params, steps)]
        bitmask = fill_bitmask([c.seq.grammar for c, _ in rows], logits.shape[1],
                               pin=self.device.type == "cuda")
        if greedy is not None and every_row and all(p.greedy for p in params) and not any(
                banned or ()) and bitmask is None:
            # NOTE: the replay's argmax wrote the samples (device and host) and logprobs' stats
            tokens, found = greedy
            return tokens, step_logprobs(logits, self.sampled, params,
                                         (found, self.graphs.lse[: len(params)]))
        samples, tokens = self._sample(logits, [c.seq.seed for c, _ in rows], steps, params,
                                       banned, bitmask)
        return tokens, step_logprobs(logits, samples, params)

    def _sample(self, logits: torch.Tensor, seeds: list[int], steps: list[int], params,
                banned: list[list[int]] | None, bitmask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples of the sampling rows, written where a step queued ahead reads its inputs:
        (on the device, host copy). A step with drafts has more rows than that buffer: nothing
        is queued ahead of it (scheduler.schedule_ahead)."""
        where = self.sampled[: len(params)] if len(params) <= len(self.sampled) else None
        cuda = self.device.type == "cuda"
        # NOTE: on CUDA written in place (no copy kernel); on the CPU download() returns the
        # tensor itself, so it must stay apart
        samples = sample(logits, params, seeds, steps, out=where if cuda else None, banned=banned,
                         bitmask=bitmask)
        if not cuda and where is not None:
            where.copy_(samples)
        return samples, download(samples)

    def complete(self, step: Launched) -> list[int | list[int] | None]:
        """Wait for a launched step: per chunk its sampled token (a chunk with a draft: the
        target's token at each of its rows, a list), None where none was; with EAGLE-3 the
        head then drafts from them."""
        if step.done is not None:
            step.done.synchronize()
        tokens = self._per_chunk(step)
        if self.drafter is not None:
            self.drafter.draft(step, tokens)
        return tokens

    @staticmethod
    def _per_chunk(step: Launched) -> list[int | list[int] | None]:
        flat = step.tokens.tolist() if step.tokens is not None else []
        if len(flat) == sum(step.sampled):
            it = iter(flat)
            return [next(it) if f else None for f in step.sampled]
        out, at = [], 0
        for c, f in zip(step.chunks, step.sampled):
            n = c.num_samples if f else 0
            out.append(None if not f else flat[at] if not c.draft else flat[at : at + n])
            at += n
        return out

    def _forward_eager(self, chunks: list[Chunk], sources: list[int], sampled: list[bool],
                       plan: RowPlan | None, aux: HiddenCapture | None = None):
        ids, positions, slot_mapping, row_sources = [], [], [], []
        logit_rows, capture_rows = [], []
        row = 0
        for i, (c, src, samples) in enumerate(zip(chunks, sources, sampled)):
            seq = c.seq
            ids += [0] if c.ahead else c.input_ids()
            row_sources += [src] * c.num_tokens
            positions += range(c.start, c.end)
            slot_mapping += self.plan.slots(seq.block_table, c.start, c.end)
            if samples:  # NOTE: a draft's chunk: every row, the target's view of each position
                logit_rows += range(row + c.num_tokens - c.num_samples, row + c.num_tokens)
            if plan is not None and plan.slices[i][1]:  # NOTE: a chunk's rows are its last ones
                first = row + c.num_tokens - plan.slices[i][1]
                capture_rows += range(first, row + c.num_tokens)
            row += c.num_tokens
        dev = self.device
        batch = self.plan.batch(chunks, slot_mapping)
        capture = None
        if capture_rows:
            capture = HiddenCapture(plan.layers, torch.tensor(capture_rows, device=dev),
                                    self.model.spec.hidden_size, self.model.embed.dtype)
        logit_index = torch.tensor(logit_rows, device=dev) if logit_rows else None
        ids_t = torch.tensor(ids, device=dev)
        if any(s >= 0 for s in sources):
            src = torch.tensor(row_sources, device=dev)
            ids_t = torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids_t)
        taps = capture if aux is None else aux if capture is None else Taps(capture, aux)
        hidden = self.model(ids_t, torch.tensor(positions, device=dev), batch, self.kv_cache, taps)
        logits = self.model.logits(hidden[logit_index]) if logit_index is not None else None
        block = capture.out if capture is not None else None
        return (logits, block, plan.layers if plan is not None else [], None,
                self._prompt_logprobs(chunks, hidden))

    def _prompt_logprobs(self, chunks: list[Chunk], hidden: torch.Tensor):
        """Prompt logprobs of the chunks with a prompt span (each rank alike: the logits are a
        collective under tensor parallelism)."""
        found, row = [], 0
        for i, c in enumerate(chunks):
            if c.prompt_span is not None:
                lo, hi, k = c.prompt_span
                ids = c.seq.token_ids[lo + 1 : hi + 1]
                # NOTE: a tensor parallel rank sees this chunk's tokens only: its (unread) targets
                # are padded to the same rows
                targets = upload(ids + [0] * (hi - lo - len(ids)), self.device)
                stats, top = prompt_logprobs(self.model.logits,
                                             hidden[row + lo - c.start : row + hi - c.start],
                                             targets, k)
                found.append(PromptLogprobs(i, lo + 1, k, stats, top))
            row += c.num_tokens
        return found or None

    def _forward_graph(self, chunks: list[Chunk], sources: list[int], sampled: list[bool],
                       plan: RowPlan | None, with_rows: bool | None = None):
        """A decode-shaped step through the captured graphs: a row per chunk, or per position of
        a draft's verify, each attending up to its own (every row's K/V is written first)."""
        g, dev = self.graphs, self.device
        inputs, first = graph_inputs(chunks, sources, self.plan)
        n = len(inputs[0])
        sampling = [r for i, f in enumerate(sampled) if f for r in _last(chunks, first, i)]
        pick = upload(sampling, dev) if 0 < len(sampling) < n else None
        keep = [r for i in plan.with_rows for r in _last(chunks, first, i, plan.slices[i][1])
                ] if plan is not None else []
        keep_index = upload(keep, dev) if 0 < len(keep) < n else None
        layers, cols = g.layers, None
        column = {k: j for j, k in enumerate(layers)}
        if keep and len(plan.layers) < len(layers):  # NOTE: only the layers asked for leave the GPU
            cols, layers = upload([column[k] for k in plan.layers], dev), plan.layers
        if with_rows is None:
            with_rows = bool(keep) or self.drafter is not None
        logits, rows, greedy, greedy_logprobs = g.run(*inputs, with_rows=with_rows)
        aux = None
        if self.drafter is not None and rows is not None:  # NOTE: copied: the buffer is live
            aux = self.drafter.tap_rows(rows[:, [column[k] for k in self.drafter.layers]])
        if not sampling:
            logits = None
        elif pick is not None:
            logits = logits[pick]
        greedy = (greedy, greedy_logprobs)
        if not keep:
            return logits, None, [], greedy, None, aux
        block = rows[keep_index] if keep_index is not None else rows
        return (logits, block if cols is None else block[:, cols], layers, greedy, None, aux)


def _last(chunks: list[Chunk], first: list[int], i: int, count: int | None = None) -> range:
    """Chunk i's last `count` (all) rows in a graph step."""
    end = first[i] + chunks[i].num_tokens
    return range(end - (chunks[i].num_tokens if count is None else count), end)


def graph_inputs(chunks: list[Chunk], sources: list[int], plan: AttentionPlanner):
    """A graph step's per-row inputs (ids, sources, positions, slots, tables, lengths) and each
    chunk's first row; one row per chunk unless a chunk verifies a draft."""
    if not any(c.draft for c in chunks):  # NOTE: the common step, kept cheap
        return ([0 if c.ahead else c.seq.token_ids[c.start] for c in chunks], sources,
                [c.start for c in chunks],
                [plan.slot(c.seq.block_table, c.start) for c in chunks],
                [c.seq.block_table for c in chunks], [c.end for c in chunks]), range(len(chunks))
    ids, srcs, positions, slots, tables, lens, first = [], [], [], [], [], [], []
    for c, src in zip(chunks, sources):
        first.append(len(ids))
        ids += [0] if c.ahead else c.input_ids()
        srcs += [src] * c.num_tokens
        positions += range(c.start, c.end)
        slots += plan.slots(c.seq.block_table, c.start, c.end)
        tables += [c.seq.block_table] * c.num_tokens
        lens += range(c.start + 1, c.end + 1)
    return (ids, srcs, positions, slots, tables, lens), first
