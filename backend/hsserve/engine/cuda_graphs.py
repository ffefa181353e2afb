"""DecodeGraphs: the decode step (every row one token) as CUDA graphs, captured once at start.
A draft's verify fits too: its positions are rows of their own (executor.graph_inputs).

One graph per batch size of a ladder (a batch runs in the smallest size that holds it; padding
rows have length 0 and slot -1, so they read and write nothing) and, when the server's ceiling is
above `none`, a second graph per size that also copies every captured layer's rows into a static
buffer. A step whose rows are all MODE=none (or not due yet) replays the graph without the copy,
so it pays nothing for the ceiling. Logits (float32) and every row's greedy sample (the argmax)
are computed inside the graph; the argmax also writes the samples into pinned host memory (one
of two host slots, used in turn as the input slots are), with each row's logsumexp and its
greedy token's log-probability (logprobs), so an all-greedy step queues no copy after its
replay. Other sampling and the rows' device-to-host copies happen after the replay.
Nothing is captured after start: `num_captures` proves it.

A row's input token is either given by the host or, when the engine queued this step before it
read the previous one, the previous step's sample still on the device: row 0 of the static
buffer holds the samples (the graph's argmax writes them there, or the executor's sampler after
it, for a step that is not all greedy), and each row names where its token is
(`source`, a flat index into the buffer), so the graph picks every input with one gather.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hsserve.models.attention_batch import AttentionBatch
from hsserve.models.hidden_capture import HiddenCapture
from hsserve.kernels.argmax import argmax_rows
from hsserve.models.decoder import Decoder

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if s < max_batch]
    sizes += list(range(96, max_batch, 32))
    return sizes + [max_batch]


def fill_host_inputs(meta: np.ndarray, ids: list[int], sources: list[int], positions: list[int],
                     slots: list[int], lens: list[int], size: int) -> None:
    """Write one step's inputs into the host buffer (a numpy view of the pinned tensor; numpy
    takes Python lists at half the cost of torch.tensor): meta rows ids, sources, positions,
    slots, lengths for n = len(ids) rows, padding rows n..size-1 (slot -1, length 0: they write
    and read nothing). A row's source is where the graph reads its input token in the static
    buffer [samples; ids; ...] of width meta.shape[1]: its entry of `ids` when `sources` gives
    -1, else that entry of the samples."""
    n = len(ids)
    b = meta.shape[1]
    src = np.asarray(sources, dtype=np.int64)
    meta[:, :n] = (ids, np.where(src >= 0, src, b + np.arange(n)), positions, slots, lens)
    meta[1, n:size] = 0
    meta[3, n:size] = -1
    meta[4, n:size] = 0


class DeviceTables:
    """Which block tables the device's table buffer holds: the host lists they were copied from
    (held, compared by identity) and their lengths. A running sequence's list is only ever
    appended to (a longer length shows it); admission and preemption give it a new list."""

    def __init__(self):
        self._lists: list[list[int]] = []
        self._lens: list[int] = []

    def changed(self, tables: list[list[int]]) -> bool:
        """True (and remembered as on the device) unless `tables` are what the device holds."""
        lens = [len(t) for t in tables]
        if lens == self._lens and all(a is b for a, b in zip(self._lists, tables)):
            return False
        self._lists, self._lens = list(tables), lens
        return True


def pack_tables(out: np.ndarray, tables: list[list[int]]) -> int:
    """Each row's block table, zero-padded to the widest, packed as [rows, width] at the start of
    the flat `out`; returns the width."""
    width = max(len(t) for t in tables)
    out[: len(tables) * width].reshape(len(tables), width)[:] = [t + [0] * (width - len(t)) for t in tables]
    return width


class DecodeGraphs:
    def __init__(self, model: Decoder, kv_cache: torch.Tensor, max_batch: int, max_pages: int,
                 layers: list[int]):
        """layers: the captured layer set (normalized, column order); [] when the ceiling is none."""
        dev = kv_cache.device
        spec = model.spec
        self.model, self.kv_cache = model, kv_cache
        self.sizes = batch_ladder(max_batch)
        self.max_batch = max_batch
        self.layers = list(layers)
        b = max_batch
        # NOTE: one int64 [7, B] buffer: row 0 the last samples (written by the executor), rows
        # 1-6 (ids, sources, positions, slots, lengths, [host slot, 0...]) filled by a single
        # copy from pinned host memory per step, and one block-table buffer likewise
        self.buf = torch.zeros(7, b, dtype=torch.long, device=dev)
        self.sampled, self.meta = self.buf[0], self.buf[1:]
        self.meta[3].fill_(-1)
        _, self.sources, self.positions, self.slots, self.lens, slot = self.meta.unbind(0)
        self.host_slot = slot[0]  # NOTE: where in host_samples this step's argmax writes
        self.tables = torch.zeros(b, max_pages, dtype=torch.int32, device=dev)
        self.split_counters = torch.zeros(b * spec.num_kv_heads, dtype=torch.int32, device=dev)
        # NOTE: two host slots, used in turn: a step's copies out of its slot may still be queued
        # when the next step is prepared (steps overlap), never when the one after is
        self.host_meta = torch.zeros(2, 6, b, dtype=torch.long).pin_memory()
        self.host_meta[1, 5, 0] = 1  # NOTE: each input slot names its own samples slot
        self.host_samples = torch.zeros(2, b, dtype=torch.long).pin_memory()
        self.host_logprobs = torch.zeros(2, 2, b, dtype=torch.float32).pin_memory()
        self.lse = torch.zeros(b, dtype=torch.float32, device=dev)
        self.host_tables = torch.zeros(2, b * max_pages, dtype=torch.int32).pin_memory()
        self.tables_stage = torch.zeros(b * max_pages, dtype=torch.int32, device=dev)
        self.host_meta_np, self.host_tables_np = self.host_meta.numpy(), self.host_tables.numpy()
        self._turn = 0
        self.rows_index = torch.arange(b, device=dev)
        self.logits = torch.empty(b, spec.vocab_size, dtype=torch.float32, device=dev)
        self._device_tables = DeviceTables()
        self.rows = (
            torch.empty(b, len(self.layers), spec.hidden_size, dtype=model.embed.dtype, device=dev)
            if self.layers else None
        )
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.num_captures = 0

    def _forward(self, size: int, with_rows: bool) -> None:
        batch = AttentionBatch(
            slot_mapping=self.slots[:size],
            decode_rows=self.rows_index[:size],
            decode_block_tables=self.tables[:size],
            decode_seq_lens=self.lens[:size],
            decode_counters=self.split_counters,
            kernels=True,
        )
        capture = None
        if with_rows:
            spec = self.model.spec
            capture = HiddenCapture(self.layers, None, spec.hidden_size, self.model.embed.dtype,
                                    out=self.rows[:size])
        ids = self.buf.view(-1)[self.sources[:size]]
        self.model.decode_logits(ids, self.positions[:size], batch, self.kv_cache, capture,
                                 out=self.logits[:size])
        # NOTE: every row's greedy sample, where the next step reads its input tokens (read
        # above, so rewriting them here is safe): a greedy step needs no kernel launched from
        # Python and no gap after the replay (bench/README.md#argmax-in-the-decode-graphs)
        argmax_rows(self.logits[:size], out=self.sampled[:size],
                    host=(self.host_samples, self.host_slot),
                    lse=(self.lse[:size], self.host_logprobs))

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None, rows: bool = True) -> None:
        """Capture every (size, with_rows) graph; called once, before serving. sizes / rows=False:
        only those sizes' graphs without rows (a benchmark recapturing one graph)."""
        pool = torch.cuda.graph_pool_handle()
        variants = [False, True] if self.layers and rows else [False]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(sizes or self.sizes):  # NOTE: largest first: the rest fit its pool
                for with_rows in variants:
                    self._forward(size, with_rows)  # warm-up: compiles kernels, writes nothing
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._forward(size, with_rows)
                    self.graphs[(size, with_rows)] = graph
                    self.num_captures += 1
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch sizes %s)", self.num_captures, self.sizes)

    def run(self, ids: list[int], sources: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int], with_rows: bool):
        """Replay for len(ids) sequences (`sources` as in fill_host_inputs; `tables` the
        sequences' own block-table lists); returns (logits [n, vocab], rows [n, layers, hidden]
        or None, greedy [n], greedy_logprobs [2, n]) as views of the static buffers (valid until
        the next run is queued). Each row's greedy sample (the argmax of its logits) is in
        `sampled`[:n] and its logsumexp in `lse`[:n] after the replay; the pinned `greedy` and
        `greedy_logprobs` (the greedy token's log-probability, the logsumexp) hold them once the
        replay is done (valid until the run after the next is queued)."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        t = self._turn
        self._turn ^= 1
        fill_host_inputs(self.host_meta_np[t, :5], ids, sources, positions, slots, lens, size)
        # NOTE: host-to-device copies only between contiguous buffers (a strided one goes
        # through a pageable temporary, and a pageable copy may wait for the device): meta
        # whole, the tables packed [n, width], then spread on the device
        self.meta.copy_(self.host_meta[t], non_blocking=True)
        if self._device_tables.changed(tables):  # NOTE: most steps: the same tables as before
            width = pack_tables(self.host_tables_np[t], tables)
            stage = self.tables_stage[: n * width]
            stage.copy_(self.host_tables[t, : n * width], non_blocking=True)
            self.tables[:n, :width].copy_(stage.view(n, width))
        self.graphs[(size, with_rows and self.rows is not None)].replay()
        rows = self.rows[:n] if with_rows and self.rows is not None else None
        return self.logits[:n], rows, self.host_samples[t, :n], self.host_logprobs[t, :, :n]
