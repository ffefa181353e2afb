"""DraftGraphs: the EAGLE-3 head's step as CUDA graphs, captured once at start.

A head step is a batch of rows, each at its own position attending up to it in the head's cache
(every row's K/V is written first): the catch-up over a step's kept positions (several rows a
sequence) and each further draft (one row a sequence) alike. One graph per size of the decode
graphs' ladder; padding rows have slot -1 and length 0, so they read and write nothing. Inputs
go through one static buffer; the pre-norm output and the greedy target ids come back as views
of static buffers, valid until the next replay.
"""

from __future__ import annotations

import logging

import torch

from hsserve.engine.cuda_graphs import batch_ladder
from hsserve.models.attention_batch import AttentionBatch
from hsserve.models.eagle3 import Eagle3Head

log = logging.getLogger(__name__)


class DraftGraphs:
    def __init__(self, head: Eagle3Head, kv: torch.Tensor, max_rows: int, max_pages: int):
        dev, s = kv.device, head.spec.layer
        self.head, self.kv = head, kv
        self.sizes = batch_ladder(max_rows)
        self.max_rows = max_rows
        b = max_rows
        self.meta = torch.zeros(4, b, dtype=torch.long, device=dev)  # ids, positions, slots, lens
        self.meta[2].fill_(-1)
        self.ids, self.positions, self.slots, self.lens = self.meta.unbind(0)
        self.tables = torch.zeros(b, max_pages, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(b * s.num_kv_heads, dtype=torch.int32, device=dev)
        self.rows_index = torch.arange(b, device=dev)
        self.state = torch.zeros(b, s.hidden_size, dtype=head.embed.dtype, device=dev)
        self.out = torch.zeros_like(self.state)
        self.best = torch.zeros(b, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_captures = 0

    def _forward(self, size: int) -> None:
        batch = AttentionBatch(slot_mapping=self.slots[:size], decode_rows=self.rows_index[:size],
                               decode_block_tables=self.tables[:size],
                               decode_seq_lens=self.lens[:size], decode_counters=self.counters,
                               kernels=True)
        out, best = self.head(self.ids[:size], self.positions[:size], self.state[:size], batch,
                              self.kv)
        self.out[:size].copy_(out)
        self.best[:size].copy_(best)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size's graph; called once, before serving."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # NOTE: largest first: the rest fit its pool
                self._forward(size)  # warm-up: compiles kernels, writes nothing (slots -1)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._forward(size)
                self.graphs[size] = graph
                self.num_captures += 1
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d draft graphs (rows %s)", self.num_captures, self.sizes)

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def run(self, ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            tables: list[list[int]], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over len(ids) rows (ids: a list, or on the device; tables: each row's
        block table; state: [rows, H] on the device); returns (pre-norm output, greedy target
        ids) for those rows."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        pad = size - n
        lens = [p + 1 for p in positions]
        known = ids if isinstance(ids, list) else [0] * n
        host = torch.tensor([known + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                             lens + [0] * pad], dtype=torch.long)
        self.meta[:, :size].copy_(host, non_blocking=True)
        if isinstance(ids, torch.Tensor):
            self.ids[:n].copy_(ids)
        width = max(len(t) for t in tables)
        packed = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.tables[:n, :width].copy_(packed, non_blocking=True)
        self.state[:n].copy_(state)
        self.graphs[size].replay()
        return self.out[:n], self.best[:n]
