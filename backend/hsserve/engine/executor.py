"""Executor: runs one scheduled batch on the device (mechanism only; policy is the scheduler's).

Builds the flat token batch and its AttentionBatch, runs the decoder with hidden-state capture
for the rows that leave the device, computes logits where a token is sampled (a decode graph
computes them for every row), samples.
`launch` queues all of that and the copies of its results to the host without waiting for the
device; `complete` waits for them. Between the two the engine may queue the next step, whose
input tokens are this step's samples, still on the device (Chunk.ahead).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from hsserve.models.attention_batch import AttentionBatch, Span, visible_keys
from hsserve.engine.cuda_graphs import DecodeGraphs
from hsserve.models.hidden_capture import HiddenCapture
from hsserve.kernels import kernels_supported
from hsserve.kernels.paged_prefill_attention import varlen_metadata
from hsserve.models.decoder import Decoder
from hsserve.request import HiddenStatesMode
from hsserve.engine.sampler import sample
from hsserve.engine.scheduler import Chunk
from hsserve.engine.transfer import download, fetch, upload


@contextmanager
def flagged(event: threading.Event):
    """`event` set for the duration of the block: the loop thread is blocked there (on the device,
    or on its inbox) and needs no GIL."""
    event.set()
    try:
        yield
    finally:
        event.clear()


class CapturedRows:
    """One step's hidden rows [rows, len(layers), hidden] (the model's dtype); a chunk's rows are
    cut out (as float32) only when used. On the host, or, for a step whose rows are all
    MODE=last, left on the device (`stream` given): a step queued ahead takes every MODE=last
    row, only each sequence's final one is ever published, and only a step that ends one is
    copied. `live`: the rows are the decode graphs' static buffer, which the next replay
    rewrites; before the next step is queued the executor settles them: copied out when a row
    ends its sequence, else dropped (most steps: nothing is copied)."""

    def __init__(self, block: torch.Tensor, layers: list[int],
                 stream: torch.cuda.Stream | None = None, live: bool = False):
        self.block: torch.Tensor | None = block
        self.layers = layers  # in column order
        self._column = {k: i for i, k in enumerate(layers)}
        self._stream = stream
        self.live = live
        self._ready: torch.cuda.Event | None = None  # NOTE: settled: the copy to the host is done
        self._np: np.ndarray | None = None  # NOTE: the host block as numpy, once taken from

    def settle(self, needed: bool) -> None:
        """Live rows, before the next replay is queued: a host copy queued now (ahead of that
        replay) when `needed`, else dropped."""
        if needed and self.block.is_cuda:
            self.block = download(self.block)
            self._ready = torch.cuda.Event()
            self._ready.record()
        elif needed:
            self.block = self.block.clone()
        else:
            self.block = None
        self._stream, self.live = None, False

    def take(self, first: int, count: int, wanted: tuple[int, ...]) -> torch.Tensor:
        """Rows first..first+count-1 of the layers `wanted` (in that order) ->
        [count, len(wanted) * hidden] float32 on the host. Called once the step completed."""
        if self.block is None:
            raise RuntimeError("hidden rows taken after they were dropped (executor bug)")
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        if self._stream is not None:  # NOTE: the block comes to the host once, when first used
            self.block, self._stream, self.live = fetch(self.block, self._stream), None, False
        if self._np is None:  # NOTE: numpy views, no copy: a take's ops cost ~1 us, not ~10
            b = self.block
            self._np = b.view(torch.int16).numpy().view(np.uint16) if b.dtype == torch.bfloat16 \
                else b.numpy()
        rows = self._np[first : first + count]
        if list(wanted) != self.layers:
            rows = rows[:, [self._column[k] for k in wanted]]
        rows = rows.reshape(count, -1)
        if rows.dtype == np.uint16:  # NOTE: bfloat16 bits: the high half of a float32
            out = rows.astype(np.uint32)
            out <<= 16
            return torch.from_numpy(out.view(np.float32))
        return torch.from_numpy(rows.astype(np.float32))  # NOTE: a copy, never a view of the block


@dataclass
class StepOutput:
    tokens: list[int | None]  # per chunk: the sampled token, None where none was sampled
    captured: CapturedRows | None  # the step's hidden rows
    slices: list[tuple[int, int]]  # per chunk: (first, count) of its rows in captured


@dataclass
class Launched:
    """A step queued on the device whose results have not been read."""

    chunks: list[Chunk]
    sampled: list[bool]  # per chunk: a token was sampled (decided at launch)
    tokens: torch.Tensor | None  # host copy of the samples, one per sampling chunk
    captured: CapturedRows | None  # host copy of the rows that leave the device
    slices: list[tuple[int, int]]  # per chunk: (first, count) of its rows in captured
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)


def rows_to_capture(chunk: Chunk) -> range:
    """Token positions of this chunk whose hidden rows must leave the device."""
    seq = chunk.seq
    if seq.hidden_mode == HiddenStatesMode.FULL:
        # NOTE: after a preemption, rows already produced are recomputed but not returned again.
        return range(max(chunk.start, seq.num_rows_done), chunk.end)
    if seq.hidden_mode == HiddenStatesMode.LAST and (
        chunk.ahead or (chunk.completes and seq.finish_reason)
    ):
        # NOTE: a step queued ahead cannot know whether its input is the last token (EOS is
        # read later): the row is taken, and kept only if it was
        return range(chunk.end - 1, chunk.end)
    return range(0)


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
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = kv_cache.device
        self.window = model.spec.sliding_window
        self.dtype = model.embed.dtype
        self.kernels = kernels_supported(self.device, block_size, model.spec.head_dim)
        self.group = model.spec.num_heads // model.spec.num_kv_heads
        # NOTE: set while this thread is blocked on the device (it holds no GIL then): other
        # Python threads of the process (the Triton adapter's sender) do their work in that window
        self.device_wait = threading.Event()
        self._sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=self.device)
        # NOTE: MODE=last rows kept on the device are copied out on this stream, past the steps
        # queued after theirs
        self._fetch_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # NOTE: the last graph step's MODE=last rows, still in the graphs' buffer (CapturedRows)
        self._live: tuple[CapturedRows, list[Chunk], list[tuple[int, int]]] | None = None

    @property
    def sampled(self) -> torch.Tensor:
        """The last step's samples, on the device, where a step queued ahead reads its inputs
        (the decode graphs read them from their own static buffer)."""
        return self.graphs.sampled if self.graphs is not None else self._sampled

    def _slot(self, block_table: list[int], position: int) -> int:
        """Where the K/V of the token at `position` goes in the cache (a flat slot index)."""
        bs = self.block_size
        return block_table[position // bs] * bs + position % bs

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        return [self._slot(block_table, p) for p in range(start, end)]

    def _attention_batch(self, chunks: list[Chunk], slot_mapping: list[int]) -> AttentionBatch:
        dev = self.device
        batch = AttentionBatch(slot_mapping=torch.tensor(slot_mapping, device=dev), kernels=self.kernels)
        decode = [(i, c) for i, c in enumerate(chunks) if c.num_tokens == 1]
        row = 0
        rows_of = []
        for c in chunks:
            rows_of.append(row)
            row += c.num_tokens
        if self.kernels and len(decode) < len(chunks):
            bs = self.block_size
            batch.varlen = varlen_metadata(
                [(rows_of[i], c.num_tokens, c.start, c.seq.block_table[: -(-c.end // bs)])
                 for i, c in enumerate(chunks)], self.group, dev)
            return batch
        if decode:
            bs = self.block_size
            num_blocks = max(-(-c.end // bs) for _, c in decode)
            tables = [c.seq.block_table[:num_blocks] for _, c in decode]
            batch.decode_rows = torch.tensor([rows_of[i] for i, _ in decode], device=dev)
            batch.decode_block_tables = torch.tensor(
                [t + [0] * (num_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev
            )
            lens = torch.tensor([c.end for _, c in decode], dtype=torch.int32, device=dev)
            batch.decode_seq_lens = lens
            if not self.kernels:  # NOTE: the reference needs a mask; the kernels read the lengths
                keys = torch.arange(num_blocks * bs, device=dev)
                mask = keys[None, :] < lens[:, None]
                if self.window is not None:
                    mask &= keys[None, :] > lens[:, None] - 1 - self.window
                bias = torch.zeros(mask.shape, dtype=self.dtype, device=dev)
                batch.decode_bias = bias.masked_fill_(~mask, float("-inf"))
        groups: list[tuple[int, int, list[list[int]], torch.Tensor | None]] = []
        for i, c in enumerate(chunks):
            if c.num_tokens == 1:
                continue
            slots = self._slots(c.seq.block_table, 0, c.end)
            plain = c.start == 0 and (self.window is None or c.end <= self.window)
            if plain and groups:
                start, n, members, mask = groups[-1]
                # NOTE: equal fresh prompts in consecutive rows share one attention call
                if mask is None and n == c.num_tokens and start + n * len(members) == rows_of[i]:
                    members.append(slots)
                    continue
            mask = None
            if not plain:
                mask = visible_keys(torch.arange(c.start, c.end, device=dev), c.end, self.window)
            groups.append((rows_of[i], c.num_tokens, [slots], mask))
        batch.spans = [
            Span(start, n, torch.tensor(members, device=dev), mask)
            for start, n, members, mask in groups
        ]
        return batch

    @torch.inference_mode()
    def launch(self, chunks: list[Chunk], prev: Launched | None = None) -> Launched:
        """Queue one step and the copies of its results; chunks queued ahead take their input
        tokens from prev's samples on the device. Never waits for the device on the graph path."""
        if self._live is not None:
            self._settle_live()
        sources = sources_of(chunks, prev)
        sampled = [c.samples for c in chunks]
        g = self.graphs
        graph = g is not None and len(chunks) <= g.max_batch and all(c.num_tokens == 1 for c in chunks)
        forward = self._forward_graph if graph else self._forward_eager
        logits, captured, layers, slices, last_only, greedy = forward(chunks, sources, sampled)
        tokens = None
        if logits is not None:
            sampling = [c for c, f in zip(chunks, sampled) if f]
            params = [c.seq.sampling for c in sampling]
            if graph and len(sampling) == len(chunks) and all(p.greedy for p in params):
                # NOTE: the replay's own argmax wrote them, row by row, here and to the host
                tokens = greedy
            else:
                # NOTE: on CUDA written where the next step queued ahead reads its inputs (no
                # copy kernel); on the CPU download() returns the tensor itself, so it must stay
                # apart
                where = self.sampled[: len(sampling)]
                cuda = self.device.type == "cuda"
                samples = sample(logits, params, [c.seq.seed for c in sampling],
                                 [c.end - c.seq.num_prompt_tokens for c in sampling],
                                 out=where if cuda else None)
                if not cuda:
                    where.copy_(samples)
                tokens = download(samples)
        if captured is not None:
            if self._fetch_stream is not None and last_only:
                # NOTE: MODE=last only: the rows stay on the device, and the one a sequence ends
                # with is fetched then; the graphs' buffer is settled before the next step
                captured = CapturedRows(captured, layers, self._fetch_stream, live=graph)
                if graph:
                    self._live = (captured, chunks, slices)
            else:  # NOTE: in the model's dtype (half the bytes of float32)
                captured = CapturedRows(download(captured), layers)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(chunks, sampled, tokens, captured, slices, done)

    def _settle_live(self) -> None:
        """The last graph step's MODE=last rows, before a replay rewrites them: copied out when
        one of them ends its sequence (its end decided when the step's input token was read,
        or known by length), else dropped. Rows are only ever taken while their own step is
        processed, and that step's sequences had their previous step processed already."""
        captured, chunks, slices = self._live
        self._live = None
        if captured.live:
            captured.settle(any(n and (c.last_input or c.seq.finish_reason is not None)
                                for c, (_, n) in zip(chunks, slices)))

    def processed(self, step: Launched) -> None:
        """The engine is done with step's outputs: rows of it still in the graphs' buffer are no
        longer wanted (nothing, the step's sequences included, stays referenced while idle)."""
        if self._live is not None and self._live[0] is step.captured:
            self._live = None
            step.captured.settle(False)

    def complete(self, step: Launched) -> StepOutput:
        """Wait for a launched step and hand out its tokens and rows."""
        if step.done is not None:
            with flagged(self.device_wait):
                step.done.synchronize()
        it = iter(step.tokens.tolist() if step.tokens is not None else ())
        tokens = [next(it) if f else None for f in step.sampled]
        return StepOutput(tokens, step.captured, step.slices)

    def _forward_eager(self, chunks: list[Chunk], sources: list[int], sampled: list[bool]):
        ids, positions, slot_mapping, row_sources = [], [], [], []
        logit_rows, capture_rows, capture_slices = [], [], []
        layers: list[int] = []
        row = 0
        for c, src, samples in zip(chunks, sources, sampled):
            seq = c.seq
            ids += [0] if c.ahead else seq.token_ids[c.start : c.end]
            row_sources += [src] * c.num_tokens
            positions += range(c.start, c.end)
            slot_mapping += self._slots(seq.block_table, c.start, c.end)
            if samples:
                logit_rows.append(row + c.num_tokens - 1)
            wanted = rows_to_capture(c)
            capture_slices.append((len(capture_rows), len(wanted)))
            capture_rows += [row + p - c.start for p in wanted]
            if len(wanted):
                layers += [k for k in seq.hidden_layers if k not in layers]
            row += c.num_tokens
        dev = self.device
        batch = self._attention_batch(chunks, slot_mapping)
        capture = None
        if capture_rows:
            capture = HiddenCapture(
                layers,
                torch.tensor(capture_rows, device=dev),
                self.model.spec.hidden_size,
                self.model.embed.dtype,
            )
        logit_index = torch.tensor(logit_rows, device=dev) if logit_rows else None
        ids_t = torch.tensor(ids, device=dev)
        if any(s >= 0 for s in sources):
            src = torch.tensor(row_sources, device=dev)
            ids_t = torch.where(src >= 0, self.sampled[src.clamp(min=0)], ids_t)
        hidden = self.model(ids_t, torch.tensor(positions, device=dev), batch, self.kv_cache, capture)
        logits = self.model.logits(hidden[logit_index]) if logit_index is not None else None
        captured = capture.out if capture is not None else None
        last_only = all(c.seq.hidden_mode != HiddenStatesMode.FULL
                        for c, (_, n) in zip(chunks, capture_slices) if n)
        return logits, captured, layers, capture_slices, last_only, None

    def _forward_graph(self, chunks: list[Chunk], sources: list[int], sampled: list[bool]):
        """A decode-only step through the captured graphs."""
        g, dev = self.graphs, self.device
        sampling = [i for i, f in enumerate(sampled) if f]
        pick = upload(sampling, dev) if 0 < len(sampling) < len(chunks) else None
        # NOTE: one pass (this runs every step for every row): a row leaves the GPU when its
        # chunk's one token is to be captured; kept rows are in chunk order
        keep, slices, full, layer_sets = [], [], False, set()
        none, last = HiddenStatesMode.NONE, HiddenStatesMode.LAST
        for i, c in enumerate(chunks):
            seq = c.seq
            mode = seq.hidden_mode
            # NOTE: a MODE=last chunk queued ahead always gives its row (rows_to_capture's
            # rule, answered without the call: most rows of most steps)
            if mode is not none and ((mode is last and c.ahead) or rows_to_capture(c)):
                slices.append((len(keep), 1))
                keep.append(i)
                full = full or mode is not last
                layer_sets.add(seq.hidden_layers)
            else:
                slices.append((len(keep), 0))
        keep_index = upload(keep, dev) if 0 < len(keep) < len(chunks) else None
        # NOTE: the layers asked for, in the graph's (ascending) column order
        wanted_layers = sorted(set().union(*layer_sets))
        cols = None
        if keep and len(wanted_layers) < len(g.layers):
            column = {k: j for j, k in enumerate(g.layers)}
            cols = upload([column[k] for k in wanted_layers], dev)
        logits, rows, greedy = g.run(
            [0 if c.ahead else c.seq.token_ids[c.start] for c in chunks],
            sources,
            [c.start for c in chunks],
            [self._slot(c.seq.block_table, c.start) for c in chunks],
            [c.seq.block_table for c in chunks],
            [c.end for c in chunks],
            with_rows=bool(keep),
        )
        if not sampling:
            logits = None
        elif pick is not None:
            logits = logits[pick]
        layers, captured = g.layers, None
        if keep:
            captured = rows[keep_index] if keep_index is not None else rows
            if cols is not None:  # NOTE: only the layers asked for leave the GPU
                captured = captured[:, cols]
                layers = wanted_layers
        return logits, captured, layers, slices, not full, greedy
