"""DecodeGraphs: the decode step (every row one token) as CUDA graphs, captured once at start.

One graph per batch size of a ladder (a batch runs in the smallest size that holds it; padding
rows have length 0 and slot -1, so they read and write nothing) and, when the server's ceiling is
above `none`, a second graph per size that also copies every captured layer's rows into a static
buffer. A step whose rows are all MODE=none (or not due yet) replays the graph without the copy,
so it pays nothing for the ceiling. Logits (float32) are computed inside the graph; sampling and
the device-to-host copies happen after the replay. Nothing is captured after start:
`num_captures` proves it.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hsserve.attention_batch import AttentionBatch
from hsserve.hidden_capture import HiddenCapture
from hsserve.models.decoder import Decoder

log = logging.getLogger(__name__)


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64) if s < max_batch]
    sizes += list(range(96, max_batch, 32))
    return sizes + [max_batch]


def fill_host_inputs(meta: np.ndarray, tables_out: np.ndarray, ids: list[int], positions: list[int],
                     slots: list[int], lens: list[int], tables: list[list[int]], size: int) -> int:
    """Write one step's inputs into the host buffers (numpy views of the pinned tensors; numpy
    takes Python lists at half the cost of torch.tensor): meta rows ids, positions, slots, lengths
    for n = len(ids) rows, padding rows n..size-1 (slot -1, length 0: they write and read
    nothing), and each row's block table, zero-padded to the widest. Returns that width."""
    n = len(ids)
    width = max(len(t) for t in tables)
    meta[:, :n] = (ids, positions, slots, lens)
    meta[2, n:size] = -1
    meta[3, n:size] = 0
    tables_out[:n, :width] = [t + [0] * (width - len(t)) for t in tables]
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
        # NOTE: one int64 [4, B] buffer (ids, positions, slots, lengths) and one block-table
        # buffer, each filled by a single copy from pinned host memory per step
        self.meta = torch.zeros(4, b, dtype=torch.long, device=dev)
        self.meta[2].fill_(-1)
        self.ids, self.positions, self.slots, self.lens = self.meta.unbind(0)
        self.tables = torch.zeros(b, max_pages, dtype=torch.int32, device=dev)
        self.host_meta = torch.zeros(4, b, dtype=torch.long).pin_memory()
        self.host_tables = torch.zeros(b, max_pages, dtype=torch.int32).pin_memory()
        self.host_meta_np, self.host_tables_np = self.host_meta.numpy(), self.host_tables.numpy()
        self.rows_index = torch.arange(b, device=dev)
        self.logits = torch.empty(b, spec.vocab_size, dtype=torch.float32, device=dev)
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
            kernels=True,
        )
        capture = None
        if with_rows:
            spec = self.model.spec
            capture = HiddenCapture(self.layers, None, spec.hidden_size, self.model.embed.dtype,
                                    out=self.rows[:size])
        hidden = self.model(self.ids[:size], self.positions[:size], batch, self.kv_cache, capture)
        self.model.logits(hidden, out=self.logits[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, with_rows) graph; called once, before serving."""
        pool = torch.cuda.graph_pool_handle()
        variants = [False, True] if self.layers else [False]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # NOTE: largest first, so the pool fits the rest
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

    def run(self, ids: list[int], positions: list[int], slots: list[int],
            tables: list[list[int]], lens: list[int], with_rows: bool):
        """Replay for len(ids) sequences; returns (logits [n, vocab], rows [n, layers, hidden] or
        None) as views of the static buffers (valid until the next run)."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        # NOTE: the previous step's copies out of the pinned buffers are done: its results were
        # read on the host (a synchronization) before this step was scheduled
        width = fill_host_inputs(self.host_meta_np, self.host_tables_np, ids, positions, slots,
                                 lens, tables, size)
        self.meta[:, :size].copy_(self.host_meta[:, :size], non_blocking=True)
        self.tables[:n, :width].copy_(self.host_tables[:n, :width], non_blocking=True)
        self.graphs[(size, with_rows and self.rows is not None)].replay()
        rows = self.rows[:n] if with_rows and self.rows is not None else None
        return self.logits[:n], rows
