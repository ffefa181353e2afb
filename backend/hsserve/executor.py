"""Executor: runs one scheduled batch on the device (mechanism only; policy is the scheduler's).

Builds the flat token batch and its AttentionBatch, runs the decoder with hidden-state capture
for the rows that leave the device, computes logits only where a token is sampled, samples.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from hsserve.attention_batch import AttentionBatch, Span, visible_keys
from hsserve.cuda_graphs import DecodeGraphs
from hsserve.hidden_capture import HiddenCapture
from hsserve.kernels import kernels_supported
from hsserve.kernels.paged_prefill_attention import varlen_metadata
from hsserve.models.decoder import Decoder
from hsserve.request import HiddenStatesMode
from hsserve.sampler import sample
from hsserve.scheduler import Chunk


@contextmanager
def flagged(event: threading.Event):
    """`event` set for the duration of the block: the loop thread is blocked there (on the device,
    or on its inbox) and needs no GIL."""
    event.set()
    try:
        yield
    finally:
        event.clear()


@dataclass
class StepOutput:
    tokens: list[int | None]  # per chunk: the sampled token, None where none was sampled
    rows: list[torch.Tensor | None]  # per chunk: [rows, len(layers) * hidden] float32 on the CPU
    row_starts: list[int]  # per chunk: token position of its first returned row


def rows_to_capture(chunk: Chunk) -> range:
    """Token positions of this chunk whose hidden rows must leave the device."""
    seq = chunk.seq
    if seq.hidden_mode == HiddenStatesMode.FULL:
        # NOTE: after a preemption, rows already produced are recomputed but not returned again.
        return range(max(chunk.start, seq.num_rows_done), chunk.end)
    if seq.hidden_mode == HiddenStatesMode.LAST and chunk.completes and seq.finish_reason:
        return range(chunk.end - 1, chunk.end)
    return range(0)


def sample_chunks(logits: torch.Tensor | None, chunks: list[Chunk],
                  wait: Callable[[], None] | None = None) -> list[int | None]:
    """Per chunk the sampled token, or None; `logits` has one row per chunk that samples.
    `wait` (if any) is called once the sampling is queued, before the tokens are read."""
    flags = [c.samples for c in chunks]
    sampling = [c for c, f in zip(chunks, flags) if f]
    if not sampling:
        return [None] * len(chunks)
    tokens = sample(
        logits,
        [c.seq.sampling for c in sampling],
        [c.seq.seed for c in sampling],
        [c.seq.num_generated for c in sampling],
    )
    if wait is not None:
        wait()
    it = iter(tokens.tolist())
    return [next(it) if f else None for f in flags]


def split_rows(captured: torch.Tensor | None, layers: list[int], chunks: list[Chunk],
               slices: list[tuple[int, int]]) -> list[torch.Tensor | None]:
    """Per chunk its rows [n, len(its layers) * hidden] float32 on the CPU, or None: chunk i owns
    captured[first : first + n] ([rows, len(layers), hidden], `layers` in column order)."""
    rows: list[torch.Tensor | None] = [None] * len(chunks)
    if captured is None:
        return rows
    captured = captured.float().cpu()
    column = {k: i for i, k in enumerate(layers)}
    for i, (c, (first, n)) in enumerate(zip(chunks, slices)):
        if n:
            cols = [column[k] for k in c.seq.hidden_layers]
            rows[i] = captured[first : first + n][:, cols].reshape(n, -1)
    return rows


class Executor:
    def __init__(self, model: Decoder, kv_cache: torch.Tensor, block_size: int):
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
        self._wait = self._wait_device if self.device.type == "cuda" else None

    def _wait_device(self) -> None:
        with flagged(self.device_wait):
            torch.cuda.current_stream(self.device).synchronize()

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
    def execute(self, chunks: list[Chunk]) -> StepOutput:
        g = self.graphs
        if g is not None and len(chunks) <= g.max_batch and all(c.num_tokens == 1 for c in chunks):
            return self._execute_graph(chunks)
        ids, positions, slot_mapping = [], [], []
        logit_rows, capture_rows, row_starts, capture_slices = [], [], [], []
        layers: list[int] = []
        row = 0
        for c in chunks:
            seq = c.seq
            ids += seq.token_ids[c.start : c.end]
            positions += range(c.start, c.end)
            slot_mapping += self._slots(seq.block_table, c.start, c.end)
            if c.samples:
                logit_rows.append(row + c.num_tokens - 1)
            wanted = rows_to_capture(c)
            capture_slices.append((len(capture_rows), len(wanted)))
            row_starts.append(wanted.start)
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
        # NOTE: built before the forward is queued: a blocking copy after it would wait for it
        logit_index = torch.tensor(logit_rows, device=dev) if logit_rows else None
        hidden = self.model(
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            batch,
            self.kv_cache,
            capture,
        )
        logits = None
        if logit_index is not None:
            logits = self.model.logits(hidden[logit_index])
        captured = capture.out if capture is not None else None
        return StepOutput(sample_chunks(logits, chunks, self._wait),
                          split_rows(captured, layers, chunks, capture_slices), row_starts)

    def _execute_graph(self, chunks: list[Chunk]) -> StepOutput:
        """A decode-only step through the captured graphs."""
        g, dev = self.graphs, self.device
        wanted = [rows_to_capture(c) for c in chunks]
        # NOTE: index tensors built before the replay is queued (a blocking copy would wait for it)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        pick = torch.tensor(sampling, device=dev) if 0 < len(sampling) < len(chunks) else None
        keep = [i for i, w in enumerate(wanted) if len(w)]  # NOTE: only these rows leave the GPU
        keep_index = torch.tensor(keep, device=dev) if keep else None
        logits, rows = g.run(
            [c.seq.token_ids[c.start] for c in chunks],
            [c.start for c in chunks],
            [self._slot(c.seq.block_table, c.start) for c in chunks],
            [c.seq.block_table for c in chunks],
            [c.end for c in chunks],
            with_rows=any(len(w) for w in wanted),
        )
        if pick is not None:
            logits = logits[pick]
        captured = rows[keep_index] if keep_index is not None else None
        position = {i: j for j, i in enumerate(keep)}
        slices = [(position.get(i, 0), len(w)) for i, w in enumerate(wanted)]
        return StepOutput(sample_chunks(logits, chunks, self._wait),
                          split_rows(captured, g.layers, chunks, slices), [w.start for w in wanted])
