"""EAGLE-3 drafting, once a step's tokens are read: the head catches up on the positions whose
tokens the step kept (their K/V goes into the head's cache, laid out in the target's blocks and
tables, so prefix caching, preemption and freeing need nothing of their own), then drafts up to k
tokens for each sequence that decodes next, kept as seq.proposal for the scheduler
(speculative.Eagle3Proposer). Drafts are the head's greedy tokens: the target's own sampling at
every position keeps its distribution whatever they are (engine/speculative.py).

Catch-up rows: each kept position with the token after it (a prompt token or the target's sample)
and the target's three layers there, fused; a draft's chunk keeps its last input and its accepted
drafts. The last row's output is the first draft; each further draft is one head step at the next
position, reading the previous step's pre-norm output. Those K/V rows are overwritten by the next
catch-up. NOTE: the head's K/V at a cached block's last position was made with the token that
followed it in the sequence that computed it; a sequence sharing the block but not that token
drafts from it as it is (only acceptance can suffer, never a token or a row).
"""

from __future__ import annotations

import torch

from hsserve.engine.attention_plan import AttentionPlanner
from hsserve.engine.draft_graphs import DraftGraphs
from hsserve.engine.sequence import Status
from hsserve.engine.speculative import accepted_length
from hsserve.engine.types import Chunk, Launched
from hsserve.models.eagle3 import Eagle3Head
from hsserve.models.hidden_capture import HiddenCapture


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, kv: torch.Tensor, k: int, plan: AttentionPlanner):
        self.head, self.kv, self.k, self.plan = head, kv, k, plan  # kv: [2, blocks, bs, kvh, hd]
        self.layers = list(head.spec.aux_layers)
        self.graphs: DraftGraphs | None = None  # NOTE: set by engine setup on CUDA

    def tap(self, chunks: list[Chunk]) -> HiddenCapture:
        """The capture of the head's three target layers at every row of the step."""
        n = sum(c.num_tokens for c in chunks)
        size = self.head.spec.target_hidden_size
        out = torch.empty(n, len(self.layers), size, dtype=self.head.embed.dtype,
                          device=self.kv.device)
        return HiddenCapture(self.layers, None, size, out.dtype, out=out)

    def tap_rows(self, rows: torch.Tensor) -> HiddenCapture:
        """The same, from a graph replay's rows of the head's layers [rows, 3, hidden]."""
        return HiddenCapture(self.layers, None, rows.shape[-1], rows.dtype, out=rows)

    @torch.inference_mode()
    def draft(self, step: Launched, tokens: list) -> None:
        """Catch up on the step's kept positions, then set the proposals (before the step's
        tokens are appended: a proposal names the token count it follows)."""
        rows, ids, chunks, expects, row = [], [], [], [], 0
        for c, f, tok in zip(step.chunks, step.sampled, tokens):
            kept = self._kept(c, f, tok)
            if kept is not None:
                rows += range(row, row + len(kept[0]))
                ids += kept[0]
                chunks.append(Chunk(c.seq, c.start, len(kept[0])))
                expects.append(kept[1])
            row += c.num_tokens
        if not chunks:
            return
        dev = self.kv.device
        state = self.head.fuse(step.aux.out[torch.tensor(rows, device=dev)])
        out, best = self._run(chunks, ids, state)
        ends = torch.tensor([c.num_tokens for c in chunks]).cumsum(0) - 1
        live = [i for i, e in enumerate(expects) if e is not None
                and min(self.k, chunks[i].seq.max_num_tokens - e - 1) > 0]
        if not live:
            return
        pick = ends[live].to(dev)
        positions = {i: chunks[i].end for i in live}
        # NOTE: drafts stay on the device (each step's input is the last one's output) and are
        # read once, at the end
        orders, found = self._extend(chunks, expects, live, positions, out[pick],
                                     best[pick].clone())
        flat = iter(torch.cat(found).tolist())
        drafts: dict[int, list[int]] = {i: [] for i in live}
        for order in orders:
            for i in order:
                drafts[i].append(next(flat))
        for i in live:
            chunks[i].seq.proposal = (expects[i], tuple(drafts[i]))

    def _extend(self, chunks, expects, live, positions, state, best):
        """Further head steps, one row per drafting sequence, while its draft is short of k (and
        of its length limit) and its next position has a block: (each step's sequences, each
        step's drafts on the device), the first step's included."""
        bs = self.plan.block_size
        order = list(live)
        orders, found = [order], [best]
        counts = dict.fromkeys(live, 1)
        for _ in range(self.k - 1):
            keep = [j for j, i in enumerate(order)
                    if counts[i] < min(self.k, chunks[i].seq.max_num_tokens - expects[i] - 1)
                    and positions[i] < len(chunks[i].seq.block_table) * bs]
            if not keep:
                break
            index = torch.tensor(keep, device=state.device)
            order = [order[j] for j in keep]
            step = [Chunk(chunks[i].seq, positions[i], 1) for i in order]
            state, best = self._run(step, best[index], state[index])
            best = best.clone()  # NOTE: a graph's output buffer: the next replay rewrites it
            orders.append(order)
            found.append(best)
            for i in order:
                counts[i] += 1
                positions[i] += 1
        return orders, found

    def _run(self, chunks: list[Chunk], ids: list[int] | torch.Tensor, state: torch.Tensor):
        """One head step; ids: a list, or on the device (the previous step's drafts)."""
        slots = [s for c in chunks for s in self.plan.slots(c.seq.block_table, c.start, c.end)]
        positions = [p for c in chunks for p in range(c.start, c.end)]
        if self.graphs is not None and self.graphs.fits(len(ids)):
            tables = [c.seq.block_table for c in chunks for _ in range(c.num_tokens)]
            return self.graphs.run(ids, positions, slots, tables, state)
        batch = self.plan.batch(chunks, slots)
        dev = self.kv.device
        ids = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=dev)
        return self.head(ids, torch.tensor(positions, device=dev), state, batch, self.kv)

    @staticmethod
    def _kept(c: Chunk, sampled: bool, token) -> tuple[list[int], int | None] | None:
        """A chunk's kept positions as (the token after each, the token count its sequence will
        have when it drafts from them, or None when it does not draft); None: nothing kept."""
        seq = c.seq
        if seq.status is Status.FINISHED or seq.grammar is not None or c.ahead:
            return None
        if not sampled or token is None:
            if c.end >= seq.num_tokens:
                return None  # NOTE: a row-only chunk: its sequence ends
            return seq.token_ids[c.start + 1 : c.end + 1], None
        targets = token if c.draft else [token]
        m = accepted_length(c.draft, targets)
        lead = c.num_tokens - c.num_samples
        return (seq.token_ids[c.start + 1 : c.start + 1 + lead] + targets[: m + 1],
                seq.num_tokens + m + 1)
