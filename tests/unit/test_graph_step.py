"""Executor's graph path on the CPU (a stand-in replay): the right inputs, rows and tokens a step.

The host side of a decode step through the graphs (Executor.launch/complete on the graph path,
with HiddenRows planning and settling the rows as the engine loop does), on the CPU with a
stand-in for DecodeGraphs whose replay returns known logits and rows: which inputs a replay gets
(host ids, or the previous step's samples for chunks queued ahead), which rows and layers leave
the device, which tokens come back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hsserve.engine.executor import Executor
from hsserve.engine.hidden_rows import HiddenRows
from hsserve.engine.sequence import Sequence
from hsserve.engine.step_rows import StepRows
from hsserve.engine.types import Chunk
from hsserve.request import FinishReason, HiddenStatesMode, SamplingParams

VOCAB, HIDDEN, LAYERS = 11, 4, [0, 2, 3]  # NOTE: the graphs' captured layer set


class FakeGraphs:
    """Replays nothing: remembers its inputs, returns logits whose argmax is 3 + row and rows
    whose value names (row, layer column)."""

    max_batch = 8
    layers = LAYERS

    def __init__(self):
        self.sampled = torch.zeros(self.max_batch, dtype=torch.long)
        self.lse = torch.zeros(self.max_batch)
        self.calls = []

    def run(self, ids, sources, positions, slots, tables, lens, with_rows):
        n = len(ids)
        self.calls.append(dict(ids=ids, sources=sources, positions=positions, slots=slots,
                               lens=lens, with_rows=with_rows))
        logits = torch.zeros(n, VOCAB)
        logits[torch.arange(n), 3 + torch.arange(n)] = 1.0
        self.sampled[:n] = logits.argmax(-1)  # NOTE: as the real graphs' own argmax does
        rows = torch.arange(n)[:, None, None] * 10 + torch.arange(len(LAYERS))[None, :, None]
        rows = rows.expand(n, len(LAYERS), HIDDEN).float()
        self.lse[:n] = logits.logsumexp(-1)
        greedy_logprobs = torch.stack([logits.max(-1).values - self.lse[:n], self.lse[:n]])
        return (logits, rows if with_rows else None, self.sampled[:n].clone(),  # NOTE: "pinned"
                greedy_logprobs)


def make_executor() -> Executor:
    spec = SimpleNamespace(sliding_window=None, layer_windows=(), head_dim=16, num_heads=2,
                           num_kv_heads=1, eos_token_ids=(0,))
    model = SimpleNamespace(spec=spec, embed=SimpleNamespace(dtype=torch.float32))
    ex = Executor(model, torch.zeros(1, 2, 4, 4, 1, 16), block_size=4, max_num_seqs=8)
    ex.graphs = FakeGraphs()
    ex.rows = HiddenRows(torch.float32)  # NOTE: what the engine loop holds beside its executor
    return ex


def launch(ex: Executor, chunks: list[Chunk], prev=None):
    """As the engine loop's _launch: settle live rows, plan, launch."""
    ex.rows.settle()
    step = ex.launch(chunks, ex.rows.plan(chunks), prev)
    ex.rows.launched(step)
    return step


def take(step, i: int, layers: tuple[int, ...]) -> torch.Tensor:
    """Chunk i's one row of a completed step, its layers in the order given."""
    first, _ = step.plan.slices[i]
    return step.rows.take(first, 1, layers, torch.float32)


def seq(rid: str, prompt: list[int], mode=HiddenStatesMode.NONE, layers=(-1,), max_tokens=8):
    s = Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), 0, mode,
                 layers, None, None, 0, max_num_tokens=len(prompt) + max_tokens)
    s.block_table = [1, 2, 3]
    return s


def test_inputs_rows_and_tokens_of_a_step_and_the_step_queued_after_it():
    ex = make_executor()
    a = seq("a", [5, 6, 7])  # none
    b = seq("b", [5, 6], HiddenStatesMode.FULL, (3, 0))  # full: rows every step, its layers
    c = seq("c", [9, 9, 9, 9], HiddenStatesMode.LAST, (2,))  # last: a row only at its end
    for s in (a, b, c):
        s.num_computed = s.num_tokens - 1
    first = [Chunk(s, s.num_computed, 1) for s in (a, b, c)]
    step = launch(ex, first)
    call = ex.graphs.calls[-1]
    assert call["ids"] == [7, 6, 9] and call["sources"] == [-1, -1, -1]
    assert call["positions"] == [2, 1, 3] and call["lens"] == [3, 2, 4]
    assert call["slots"] == [1 * 4 + 2, 1 * 4 + 1, 1 * 4 + 3]
    assert call["with_rows"], "b (full) takes its row"
    assert ex.complete(step) == [3, 4, 5], "argmax of each row"
    assert ex.sampled[:3].tolist() == [3, 4, 5], "the samples stay on the device for the next step"
    assert [n for _, n in step.plan.slices] == [0, 1, 0]
    assert step.rows.layers == [0, 3], "only b's layers left the device"
    row = take(step, 1, b.hidden_layers)
    assert row.tolist() == [[12.0] * HIDDEN + [10.0] * HIDDEN], \
        "b's row (replay row 1), columns in its own layer order (3, 0)"

    # the step queued ahead, before `step` is read: c's input is its last by length (no sample)
    c.sampling, c.max_num_tokens = SamplingParams(max_tokens=1, temperature=0.0), 5
    ahead = [Chunk(a, 3, 1, ahead=True), Chunk(c, 4, 1, ahead=True, last_input=True)]
    for s in (a, c):
        s.num_computed += 1
    step2 = launch(ex, ahead, prev=step)
    call = ex.graphs.calls[-1]
    assert call["ids"] == [0, 0] and call["sources"] == [0, 2], "prev's samples of a and c"
    assert call["positions"] == [3, 4] and call["lens"] == [4, 5]
    assert ex.complete(step2) == [3, None], "c samples nothing"
    assert [n for _, n in step2.plan.slices] == [0, 1], "c (last, queued ahead) takes its row"
    assert step2.rows.layers == [2], "only the layers asked for leave the device"
    assert take(step2, 1, (2,)).tolist() == [[10.0 + 1] * HIDDEN]


def test_a_greedy_step_takes_the_graphs_samples_and_samples_nothing_more(monkeypatch):
    import hsserve.engine.executor as executor

    calls = []
    real = executor.sample
    monkeypatch.setattr(executor, "sample", lambda *a, **k: calls.append(a) or real(*a, **k))
    ex = make_executor()
    a, b = seq("a", [5, 6, 7]), seq("b", [5, 6])
    for s in (a, b):
        s.num_computed = s.num_tokens - 1
    tokens = ex.complete(launch(ex, [Chunk(s, s.num_computed, 1) for s in (a, b)]))
    assert tokens == [3, 4] and not calls, "all greedy: the replay's argmax, no sampler"
    b.sampling = SamplingParams(max_tokens=8, temperature=0.7, seed=3)
    for s, t in zip((a, b), tokens):
        s.token_ids.append(t)
        s.num_computed += 1
    tokens = ex.complete(launch(ex, [Chunk(s, s.num_computed, 1) for s in (a, b)]))
    assert len(calls) == 1 and tokens[0] == 3, "one row samples: the sampler runs"
    assert ex.sampled[:2].tolist() == tokens, "its samples where the next step reads them"


class StaticGraphs(FakeGraphs):
    """Rows as the real graphs give them: views of one static buffer, which every replay with
    rows rewrites (values 100 x replay + 10 x row + column)."""

    def __init__(self):
        super().__init__()
        self.buffer = torch.zeros(self.max_batch, len(LAYERS), HIDDEN)

    def run(self, *inputs, with_rows):
        logits, _, greedy, greedy_logprobs = super().run(*inputs, with_rows=False)
        n = len(inputs[0])
        if with_rows:
            self.buffer[:n] = (100.0 * len(self.calls) + 10 * torch.arange(n)[:, None, None]
                               + torch.arange(len(LAYERS))[None, :, None])
        return logits, self.buffer[:n] if with_rows else None, greedy, greedy_logprobs


def last_mode_steps(ending: str):
    """Two MODE=last sequences a, b (all layers asked: the rows are the buffer itself): a plain
    step, then a step queued ahead (both rows taken, left in the buffer), then, before that one
    is read, the next step queued. `ending`: what ends a at the ahead step ("finish": its end
    decided when the plain step was read; "length": its input is its last by length; "none")."""
    ex = make_executor()
    ex.graphs = StaticGraphs()
    ex._fetch_stream = "stand-in"  # NOTE: as on CUDA: MODE=last rows stay where they are
    a = seq("a", [5, 6, 7], HiddenStatesMode.LAST, tuple(LAYERS))
    b = seq("b", [5, 6], HiddenStatesMode.LAST, tuple(LAYERS))
    for s in (a, b):
        s.num_computed = s.num_tokens - 1
    step1 = launch(ex, [Chunk(s, s.num_computed, 1) for s in (a, b)])
    assert step1.rows is None, "nothing ends: no row leaves"
    step2 = launch(ex, [Chunk(a, a.num_tokens, 1, ahead=True, last_input=ending == "length"),
                        Chunk(b, b.num_tokens, 1, ahead=True)], prev=step1)
    assert step2.rows.live, "queued ahead: both rows taken, left in the buffer"
    ex.rows.processed(step1)
    ex.complete(step1)
    if ending == "finish":
        a.finish_reason = FinishReason.STOP  # NOTE: as if step 1 sampled EOS for a
    step3 = launch(ex, [Chunk(b, b.num_tokens + 1, 1, ahead=True)], prev=step2)  # rewrites
    return ex, step2, step3


def test_logprobs_of_a_greedy_graph_step_come_from_the_replay_and_equal_the_eager_ones():
    from hsserve.engine.logprobs import token_logprobs

    ex = make_executor()
    a, b = seq("a", [5, 6, 7]), seq("b", [5, 6])
    a.sampling = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    b.sampling = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    for s in (a, b):
        s.num_computed = s.num_tokens - 1
    step = launch(ex, [Chunk(s, s.num_computed, 1) for s in (a, b)])
    assert step.logprobs.ranks is None, "the replay's argmax: no rank kernel"
    got = token_logprobs(step.logprobs, sum(step.sampled))
    logits = torch.zeros(2, VOCAB)
    logits[[0, 1], [3, 4]] = 1.0  # NOTE: FakeGraphs' logits
    want = logits.log_softmax(-1)
    assert [e.rank for e in got] == [1, 1]
    for e, row, token in zip(got, want, (3, 4)):
        assert abs(e.logprob - row[token].item()) < 1e-6
    assert got[0].top_ids[0] == 3 and len(got[0].top_ids) == 3 and got[1].top_ids == []
    assert abs(got[0].top_logprobs[0] - want[0, 3].item()) < 1e-6
    b.sampling = SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs=1)
    for s in (a, b):
        s.token_ids.append(3)
        s.num_computed += 1
    step = launch(ex, [Chunk(s, s.num_computed, 1) for s in (a, b)])
    tokens = ex.complete(step)
    got = token_logprobs(step.logprobs, sum(step.sampled))
    assert step.logprobs.ranks is not None, "one row samples: the kernel's ranks"
    assert abs(got[1].logprob - want[1, tokens[1]].item()) < 1e-6
    assert got[1].rank == (1 if tokens[1] == 4 else 2) and got[1].top_ids == [4]


@pytest.mark.parametrize("ending", ["finish", "length"])
def test_last_rows_left_in_the_graphs_buffer_are_copied_out_before_the_next_replay_if_one_ends(
        ending):
    """MODE=last rows of a graph step stay in the graphs' buffer (no copy per step); when the next
    step is queued, before its replay rewrites the buffer, they are copied out because one of
    them ends its sequence."""
    ex, step2, step3 = last_mode_steps(ending)
    assert ex.graphs.buffer[0, 0, 0] == 300.0, "the buffer holds step 3's rows now"
    ex.complete(step2)
    row = take(step2, 0, (3, 0))
    assert row.tolist() == [[200.0 + 2] * HIDDEN + [200.0] * HIDDEN], \
        "a's row of step 2 (its last token's), layers in its order"
    ex.rows.processed(step2)
    assert step3.rows.live
    ex.complete(step3)
    ex.rows.processed(step3)
    assert step3.rows.block is None and ex.rows._live is None, "step 3 read: its rows let go"


def test_last_rows_left_in_the_graphs_buffer_are_dropped_when_none_ends():
    ex, step2, step3 = last_mode_steps("none")
    assert step2.rows.block is None, "no sequence of step 2 ends: nothing was copied"
    ex.complete(step2)
    with pytest.raises(RuntimeError, match="dropped"):
        take(step2, 0, tuple(LAYERS))
    ex.complete(step3)


@pytest.mark.parametrize("out", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_take_is_a_copy_of_its_rows_in_the_layers_and_dtype_asked(dtype, out):
    """StepRows.take converts once, on the host, to the output's dtype (bfloat16 widened through
    its bits): exact, special values included, and a copy: changing it leaves the block as it was."""
    block = torch.randn(5, 3, 8)
    block[2, 1, :4] = torch.tensor([float("inf"), -float("inf"), -0.0, -3.5])
    block = block.to(dtype)
    rows = StepRows(block, [0, 2, 5])
    got = rows.take(1, 2, (5, 0), out)
    assert got.dtype == out
    assert torch.equal(got, block[1:3][:, [2, 0]].reshape(2, -1).float().to(out))
    all_layers = rows.take(2, 1, (0, 2, 5), out)
    want = block[2:3].reshape(1, -1).float().to(out)
    assert torch.equal(all_layers, want)
    assert torch.equal(all_layers.signbit(), want.signbit())
    all_layers += 1
    assert torch.equal(rows.take(2, 1, (0, 2, 5), out), want)
