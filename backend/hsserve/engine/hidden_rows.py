"""Hidden rows: the one owner of which rows leave the device, when, and for whom (MODE).

- `HiddenRows.plan` (one call per step, for the eager and the graph path alike) says which token
  rows of each chunk are captured: full: every row not yet produced; last: the row of a chunk
  whose token may be the sequence's last (known to be, or queued ahead, when it is read later).
- `StepRows` (step_rows.py) is one step's captured rows; a sequence's are cut out in the output
  dtype, once.
- A `RowLedger` per sequence holds what was captured and not published (full: rows, and how
  many were captured; last: where the latest row is); a delta carries the rows of its own tokens, and
  in last mode the final delta carries the one row.
The scheduler and the outputs ask wants_final_row / covers_every_prompt_row. Index convention:
transformers' hidden_states[k] (models/hidden_capture).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hsserve.engine.sequence import Sequence, Status
from hsserve.engine.step_rows import RowPlan, StepRows
from hsserve.engine.types import Chunk, Launched
from hsserve.request import HiddenStatesMode

_NONE, _LAST, _FULL = HiddenStatesMode.NONE, HiddenStatesMode.LAST, HiddenStatesMode.FULL


def wants_final_row(seq: Sequence) -> bool:
    """Once its end is decided, the sequence runs one more (row-only) chunk: its last token's
    row (last and full modes)."""
    return seq.hidden_mode is not _NONE


def covers_every_prompt_row(seq: Sequence) -> bool:
    """Full mode returns a row per prompt token: none may come from the prefix cache."""
    return seq.hidden_mode is _FULL


@dataclass(slots=True)
class RowLedger:
    num_done: int = 0  # full: rows captured (published or pending)
    pending: list[torch.Tensor] = field(default_factory=list)  # full: captured, not published
    last: tuple[StepRows, int] | None = None  # last: the latest row (its step's rows, index)


class HiddenRows:
    def __init__(self, dtype: torch.dtype):
        """dtype: what the rows are handed out in (the output's, converted once)."""
        self.dtype = dtype
        self._ledgers: dict[Sequence, RowLedger] = {}
        self._live: Launched | None = None  # NOTE: the last graph step whose rows are live

    def __len__(self) -> int:
        """Sequences whose rows are held (none once every request has ended)."""
        return len(self._ledgers)

    # ---- per step ---------------------------------------------------------------------------

    def plan(self, chunks: list[Chunk]) -> RowPlan | None:
        """Which rows of this step leave the device; None when none do."""
        slices, with_rows, layer_sets, last_only, n = [], [], set(), True, 0
        for i, c in enumerate(chunks):
            seq = c.seq
            mode = seq.hidden_mode
            if mode is _NONE:
                count = 0
            elif mode is _LAST:
                count = 1 if c.ahead or (c.completes and seq.finish_reason is not None) else 0
            else:  # NOTE: after a preemption rows already produced are recomputed, not resent
                end = c.start + c.num_tokens
                count = max(0, end - max(c.start, self._ledger(seq).num_done))
                last_only = False
            slices.append((n, count))
            if count:
                n += count
                with_rows.append(i)
                layer_sets.add(seq.hidden_layers)
        if not n:
            return None
        return RowPlan(slices, with_rows, sorted(set().union(*layer_sets)), last_only)

    def launched(self, step: Launched) -> None:
        if step.rows is not None and step.rows.live:
            self._live = step

    def settle(self) -> None:
        """Before the next step is queued: the last graph step's live rows are copied out when a
        row ends its sequence (its end decided, or known by length), else dropped. Rows are only
        taken while their own step is processed, after its sequences' previous step was."""
        step, self._live = self._live, None
        if step is not None and step.rows.live:
            ends = any(n and (c.last_input or c.seq.finish_reason is not None)
                       for c, (_, n) in zip(step.chunks, step.plan.slices))
            step.rows.settle(ends)

    def record(self, step: Launched, i: int, keep: int) -> None:
        """Chunk i of a completed step: its rows go to its sequence's ledger, the first `keep`
        of them (a draft's chunk: the rows of accepted positions only, never a rejected one's)."""
        plan = step.plan
        if plan is None or not plan.slices[i][1]:
            return
        c = step.chunks[i]
        seq = c.seq
        ledger = self._ledgers.get(seq) or self._ledger(seq)
        first, count = plan.slices[i]
        if seq.hidden_mode is _FULL:
            # NOTE: a chunk's rows are its last `count`, positions end - count .. end - 1
            count = min(count, c.start + keep - (c.end - count))
            if count > 0:
                ledger.pending.append(step.rows.take(first, count, seq.hidden_layers, self.dtype))
                ledger.num_done += count
        else:
            ledger.last = (step.rows, first)

    def processed(self, step: Launched) -> None:
        """The step is done with: rows of it still live are not wanted (nothing stays held)."""
        if self._live is step:
            self._live = None
            step.rows.settle(False)

    # ---- per sequence -----------------------------------------------------------------------

    def tokens_ready(self, seq: Sequence, num_generated: int, final: bool) -> int:
        """How many of seq's generated tokens may be published now: full: those whose rows are
        captured; last: the last token waits for its row, which goes out in the final delta."""
        mode = seq.hidden_mode
        if final or mode is _NONE:
            return num_generated
        if mode is _FULL:
            return min(num_generated, self._ledger(seq).num_done - seq.num_prompt_tokens)
        return num_generated - (seq.finish_reason is not None)

    def take(self, seq: Sequence, final: bool) -> torch.Tensor | None:
        """The rows to publish with seq's next delta (full: all pending; last: the final row)."""
        ledger = self._ledgers.get(seq)
        if ledger is None:
            return None
        if seq.hidden_mode is _FULL and ledger.pending:
            rows = torch.cat(ledger.pending) if len(ledger.pending) > 1 else ledger.pending[0]
            ledger.pending = []
            return rows
        if final and ledger.last is not None:
            rows, first = ledger.last
            ledger.last = None
            return rows.take(first, 1, seq.hidden_layers, self.dtype)
        return None

    def preempted(self, seq: Sequence) -> None:
        """Its recompute captures the last row again; a kept one may hold a step's device rows."""
        ledger = self._ledgers.get(seq)
        if ledger is not None:
            ledger.last = None

    def forget(self, seq: Sequence) -> None:
        self._ledgers.pop(seq, None)

    def _ledger(self, seq: Sequence) -> RowLedger:
        ledger = self._ledgers.get(seq)
        if ledger is None:
            ledger = self._ledgers[seq] = RowLedger()
        return ledger
