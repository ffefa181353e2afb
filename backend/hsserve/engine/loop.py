"""Engine: the loop thread. submit / abort from any thread; deltas go to each request's sink.

One step: schedule (who runs) -> execute (tensors) -> postprocess (append, finish, free) ->
publish deltas. Only the loop thread touches the scheduler, the pool and the executor.

With async scheduling (on CUDA by default) a step is launched and read later: while decode step
t runs on the device, the loop queues step t+1 for the same sequences (their input tokens are
t's samples, still on the device), then reads t and postprocesses it. A sequence that stopped at
t wastes its row of t+1 (or, in full/last mode, takes it: it is its last token's row). New
prompts, preemption and anything else the scheduler decides wait until nothing is in flight.

Test-only: HSSERVE_TEST_CRASH_AFTER_STEPS=N (read once, when the Engine is made) makes the loop
itself raise after N steps, as a bug escaping it would, so that tests can kill the engine of a real
server. Never set it in production.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
from typing import Callable

import torch

from hsserve.engine.config import EngineConfig
from hsserve.engine.admission import Admission, RequestIds, not_serving
from hsserve.engine.setup import EngineParts, build_engine_parts
from hsserve.engine.executor import Launched, StepOutput, flagged
from hsserve.request import (
    Delta,
    FinishReason,
    GenerationRequest,
    HiddenStatesMode,
)
from hsserve.engine.request_stream import RequestStream
from hsserve.engine.scheduler import Chunk
from hsserve.engine.sequence import Sequence, Status
from hsserve.engine.stats import EngineSnapshot, EngineStats

log = logging.getLogger(__name__)

Sink = Callable[[Delta], None]
_STOP = object()
TEST_CRASH_ENV = "HSSERVE_TEST_CRASH_AFTER_STEPS"  # NOTE: test-only, see the module docstring


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        build: Callable[[EngineConfig], EngineParts] = build_engine_parts,
        after_round: Callable[[], None] | None = None,
    ):
        """Nothing is loaded until start(); `build` makes the model, pool and scheduler.
        `after_round`: called on the loop thread after each round of the loop (its messages
        applied, a step run) and once at the end, when every delta of the round has gone to
        the sinks (for a sink that gathers them: the engine process ships a round's at once)."""
        self.config = config
        self._build = build
        self._after_round = after_round
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, list[Sequence]] = {}  # NOTE: loop thread only; request -> its n
        self._ids = RequestIds(config)
        self._arrivals = 0
        self.num_steps = 0
        self.stats = EngineStats()
        self.num_mixed_steps = 0  # steps that ran prefill and decode together
        self.num_ahead_steps = 0  # steps queued before the previous one was read
        self.busy_s = 0.0  # seconds the loop spent in steps (the rest: idle)
        self._inflight: Launched | None = None  # NOTE: launched, not read yet (async scheduling)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"hsserve-engine-{id(self):x}", daemon=True
        )
        self._started = False
        self._stopped = False
        self._dead = False  # NOTE: the loop thread ended without being asked to
        self._crash_after_steps = int(os.environ.get(TEST_CRASH_ENV) or 0)  # NOTE: test-only

    def _install(self, p: EngineParts) -> None:
        self.spec, self.model, self.tokenizer = p.spec, p.model, p.tokenizer
        self.pool, self.scheduler, self.executor = p.pool, p.scheduler, p.executor
        self.max_model_len, self.max_prompt_tokens = p.max_model_len, p.max_prompt_tokens
        self.captured_layers = p.captured_layers
        # NOTE: set while the loop thread needs no GIL (blocked on the device, or idle)
        self.device_wait: threading.Event = p.executor.device_wait
        self.device: torch.device = p.executor.device
        self.eos_ids = frozenset(self.spec.eos_token_ids)
        mode = self.config.async_scheduling
        self._async = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self._admission = Admission(
            self.config, p.spec, p.tokenizer, p.max_model_len, p.max_prompt_tokens, p.captured_layers
        )

    # ---- client side (any thread) -------------------------------------------------------------

    def start(self) -> Engine:
        """Load the model on the loop thread and start serving; re-raises a load error here."""
        if not self._started:
            self._started = True
            self._thread.start()
            self._ready.wait()
            if self.error is not None:
                self._stopped = True
                raise self.error
        return self

    def submit(self, request: GenerationRequest, sink: Sink | None = None) -> Sink:
        """Validate and enqueue; raises RequestError naming the bad input, EngineUnavailable when
        the queue is full or the engine is not serving. Returns the sink."""
        if not self.healthy:
            raise not_serving(self.error, self._dead)
        seqs = self._admission.make_sequences(request, sink or RequestStream(request.request_id))
        with self._ids.lock:
            self._ids.claim(request.request_id, closed=self._dead or self._stopped)
            now = EngineStats.now()
            for seq in seqs:
                self._arrivals += 1
                seq.arrival = self._arrivals
                seq.t_submit = seq.t_last = now
            self._inbox.put(("add", seqs))
        return seqs[0].sink

    def abort(self, request_id: str) -> None:
        """Cancel a request (all its completions); each gets a final delta with finish_reason
        'cancelled'."""
        self._inbox.put(("abort", request_id))

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix block (blocks held by running requests stay held)."""
        self._inbox.put(("clear_cache", None))

    def abort_all(self, message: str) -> None:
        """End every request in flight with an error delta carrying `message`."""
        self._inbox.put(("fail_all", message))

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        """Blocking convenience: submit and collect the Result."""
        return self.submit(request).result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight end with an error delta."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def thread_name(self) -> str:
        return self._thread.name

    @property
    def healthy(self) -> bool:
        """Serving: started, not stopped, and the loop thread alive."""
        return self._started and not self._stopped and not self._dead and self._thread.is_alive()

    @property
    def died(self) -> bool:
        """The loop thread ended without being asked to (its error is in `error`)."""
        return self._dead

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured (all at start; the number never grows while serving)."""
        graphs = self.executor.graphs if self.executor is not None else None
        return graphs.num_captures if graphs is not None else 0

    def snapshot(self) -> EngineSnapshot:
        """Gauges and running totals now, and the latencies observed since the last snapshot
        (drained: one reader)."""
        pool, st = self.pool, self.stats
        return EngineSnapshot(
            running=self.num_running, waiting=self.num_waiting, blocks_used=pool.num_used,
            blocks_total=pool.num_blocks, blocks_cached=pool.num_cached,
            prompt_tokens=st.prompt_tokens, generation_tokens=st.generation_tokens,
            query_tokens=pool.num_query_tokens, hit_tokens=pool.num_hit_tokens,
            graph_captures=self.num_graph_captures, ttft=EngineStats.drain(st.ttft),
            itl=EngineStats.drain(st.itl), latency=EngineStats.drain(st.latency),
        )

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: the model is built on this thread, the only one that runs torch compute: on the
        # CPU a second thread's OpenMP team (one that loaded the weights) measurably slowed
        # every step of this one (~30% at batch 1).
        torch.set_grad_enabled(False)
        try:
            self._install(self._build(self.config))
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self.error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop()

    def _loop(self) -> None:
        clean = False
        try:
            while True:
                if not self._drain(block=not self._has_work()):
                    break
                if self._has_work():
                    t0 = time.perf_counter()
                    try:
                        self._step()
                    except Exception as e:  # NOTE: fail what is in flight, keep serving
                        log.exception("engine step failed")
                        self.error = e
                        self._abandon_inflight("after a failed step")
                        self._fail_all(f"engine step failed: {e!r}")
                    self.busy_s += time.perf_counter() - t0
                    if 0 < self._crash_after_steps <= self.num_steps:  # NOTE: test-only hook
                        raise RuntimeError(f"{TEST_CRASH_ENV}={self._crash_after_steps}: crash")
                else:
                    self.pool.check_invariants()
                self._round_done()
            clean = True
        except BaseException as e:  # noqa: BLE001 - the loop died: say why to everyone waiting
            log.exception("engine loop died")
            self.error = e
        finally:
            self.device_wait.set()  # NOTE: the loop needs the GIL no more
            with self._ids.lock:  # NOTE: submit() enqueues under this lock, so nothing is missed
                self._dead = not clean
                self._drain_unprocessed()
            self._fail_all("the engine shut down" if clean else f"the engine stopped: {self.error!r}")
            self._round_done()
            log.info("engine loop ended after %d steps in %.2f s busy (%d queued ahead, %d mixed), "
                     "%d preemptions", self.num_steps, self.busy_s, self.num_ahead_steps,
                     self.num_mixed_steps, self.scheduler.num_preemptions)
            self._release()

    def _round_done(self) -> None:
        if self._after_round is None:
            return
        try:
            self._after_round()
        except Exception:  # NOTE: as a broken sink, it must not stop the loop
            log.exception("after_round failed")

    def _abandon_inflight(self, why: str) -> None:
        """Drop the launched step unread, once the device has run it (the graphs' host input
        slots are reused two steps later on the assumption that it did; memory is freed next)."""
        self._inflight = None
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:
                log.exception("device error %s", why)

    def _drain_unprocessed(self) -> None:
        """Requests still in the inbox are registered so that _fail_all ends them too."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg is not _STOP and msg[0] == "add":
                self._seqs[msg[1][0].request_id] = msg[1]

    def _release(self) -> None:
        """Drop the weights and the KV cache so their memory returns (the pool's ids stay)."""
        cuda = self.device.type == "cuda"
        self._abandon_inflight("while stopping")
        self.model = self.executor = None
        if cuda:
            gc.collect()  # NOTE: CUDA graphs and their memory pool go only when collected
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()  # NOTE: one per stream (capture used its own)
            torch.cuda.empty_cache()

    def _drain(self, block: bool) -> bool:
        """Apply queued messages; False when asked to stop."""
        try:
            if block:
                with flagged(self.device_wait):  # NOTE: idle, the loop needs no GIL
                    msg = self._inbox.get(timeout=0.5)
            else:
                msg = self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if msg is _STOP:
                return False
            kind, arg = msg
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "clear_cache":
                self.pool.clear_cache()
            else:
                self._fail_all(arg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, seqs: list[Sequence]) -> None:
        self._seqs[seqs[0].request_id] = seqs
        self.stats.prompt_tokens += seqs[0].num_prompt_tokens
        for seq in seqs:
            if seq.finish_reason is not None and not seq.wants_rows:
                self._finish(seq)  # NOTE: prompt only and no rows asked: nothing to compute
            else:
                self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        for seq in self._seqs.get(request_id, []):
            if seq.status is not Status.FINISHED:
                seq.finish_reason = FinishReason.CANCELLED
                self._finish(seq, publish_rest=False)

    def _has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def _step(self) -> None:
        prev, self._inflight = self._inflight, None
        if prev is not None:
            ahead = self._plan_ahead(prev)
            if ahead:
                self._inflight = self._launch(ahead, prev)
                self.num_ahead_steps += 1
            self._complete(prev)
            if ahead:
                return
        chunks = self.scheduler.schedule(admit=self._admit_now())
        if not chunks:
            return
        step = self._launch(chunks)
        if self._async:
            self._inflight = step
        else:
            self._complete(step)

    def _launch(self, chunks: list[Chunk], prev: Launched | None = None) -> Launched:
        step = self.executor.launch(chunks, prev)
        self.num_steps += 1
        decodes = sum(c.num_tokens == 1 for c in chunks)
        self.num_mixed_steps += 0 < decodes < len(chunks)
        return step

    def _complete(self, step: Launched) -> None:
        self._postprocess(step.chunks, self.executor.complete(step))
        self.executor.processed(step)

    def _plan_ahead(self, prev: Launched) -> list[Chunk] | None:
        """The decode step after prev for the sequences prev sampled, reading prev's samples on
        the device; None when the scheduler must decide first (read prev, then schedule)."""
        if not all(f or (c.ahead and c.last_input) for c, f in zip(prev.chunks, prev.sampled)):
            return None  # NOTE: a prompt in progress, or a step that samples nothing
        # NOTE: a row-only chunk (the row of a sequence's last token, MODE last/full) ends its
        # sequence: the others go on ahead (stopping here left the GPU idle for a step's host
        # work each time a group of sequences ended: +17% a step for MODE=last at batch 64)
        if self._admit_now():
            return None  # NOTE: prompts to admit
        chunks, grow = [], []
        bs = self.pool.block_size
        for c in prev.chunks:
            seq = c.seq
            if seq.status is not Status.RUNNING or seq.finish_reason is not None:
                continue  # NOTE: cancelled, or its end decided (only a row-only step is left)
            n = len(seq.token_ids) + 1  # NOTE: with prev's sample, not read yet
            last = self._ends_by_length(seq, n)
            if last and not seq.wants_rows:
                continue
            pos = c.end  # NOTE: == n - 1, the position of prev's sample
            chunks.append(Chunk(seq, pos, 1, ahead=True, last_input=last))
            if len(seq.block_table) * bs <= pos:  # NOTE: prev's blocks hold positions < pos
                grow.append(seq)
        if not chunks or not self.pool.can_allocate(len(grow)):
            return None  # NOTE: the scheduler preempts when the pool runs dry
        for seq in grow:
            seq.block_table += self.pool.allocate(1)
        return chunks

    def _admit_now(self) -> bool:
        """Admit waiting prompts this step: at once when nothing runs, when they fill the free
        slots, or when the oldest has waited prefill_wait_ms; until then decoding goes on, so
        that prompts arriving close together prefill in one step."""
        sched = self.scheduler
        free = self.config.max_num_seqs - len(sched.running)
        if not sched.waiting or free <= 0:
            return False
        wait = self.config.prefill_wait_ms / 1000
        if not wait or not sched.running or len(sched.waiting) >= free:
            return True
        return EngineStats.now() - sched.waiting[0].t_submit >= wait

    def _postprocess(self, chunks: list[Chunk], out: StepOutput) -> None:
        for i, c in enumerate(chunks):
            seq = c.seq
            if seq.status is Status.FINISHED:
                continue  # NOTE: stopped or cancelled while this step ran ahead
            # NOTE: a step queued ahead sampled for a sequence that then stopped: void
            decided = seq.finish_reason is not None
            seq.num_computed = c.end
            self.scheduler.cache_computed(seq)
            first, count = out.slices[i]
            if count:
                if seq.hidden_mode == HiddenStatesMode.FULL:
                    seq.pending_rows.append(out.captured.take(first, count, seq.hidden_layers))
                else:
                    seq.last_row = (out.captured, first)
            token = None if decided else out.tokens[i]
            if token is not None:
                self._append_token(seq, token)
            done = seq.finish_reason is not None and (
                not seq.wants_rows or (c.completes and token is None)
            )
            if done:
                self._finish(seq)
            else:
                self._publish(seq, final=False)

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        n = len(seq.token_ids)
        generated = n - seq.num_prompt_tokens
        now = EngineStats.now()
        self.stats.generation_tokens += 1
        (self.stats.ttft if generated == 1 else self.stats.itl).append(now - seq.t_last)
        seq.t_last = now
        sp = seq.sampling
        stopped = False
        if seq.detokenizer is not None:
            stopped = seq.stop.feed(seq.detokenizer.add(token))
        seq.text_marks.append(len(seq.stop.text))
        if stopped or token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            seq.finish_reason = FinishReason.STOP
        elif self._ends_by_length(seq, n):
            seq.finish_reason = FinishReason.LENGTH

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """A sequence of num_tokens tokens (prompt included) has reached max_tokens or
        max_model_len."""
        return (num_tokens - seq.num_prompt_tokens >= seq.sampling.max_tokens
                or num_tokens >= self.max_model_len)

    def _publish(self, seq: Sequence, final: bool) -> None:
        """Send what is ready: tokens (with their rows in full mode) and their text."""
        p = seq.num_prompt_tokens  # NOTE: slices token_ids once (output_ids would copy them all)
        generated = ready = len(seq.token_ids) - p
        mode = seq.hidden_mode
        if mode == HiddenStatesMode.FULL and not final:
            ready = min(ready, seq.num_rows_done - p)
        elif mode == HiddenStatesMode.LAST and not final and seq.finish_reason is not None:
            # NOTE: the last token waits one step for its row and goes out with it in the final
            # delta (one delta, not two, per sequence)
            ready -= 1
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
        hidden = None
        if mode == HiddenStatesMode.FULL and seq.pending_rows:
            hidden = torch.cat(seq.pending_rows)
            seq.num_rows_sent += len(hidden)
            seq.pending_rows = []
        elif final and mode == HiddenStatesMode.LAST and seq.last_row is not None:
            captured, first = seq.last_row
            hidden = captured.take(first, 1, seq.hidden_layers)
            seq.last_row = None
        seq.num_tokens_sent = ready
        delta = Delta(
            request_id=seq.request_id,
            token_ids=tokens,
            text=text,
            hidden=hidden,
            finish_reason=seq.finish_reason if final else None,
            num_input_tokens=p,
            num_output_tokens=generated,
            sequence_index=seq.index,
            request_done=final and seq.group.done,
        )
        self._send(seq, delta)

    def _send(self, seq: Sequence, delta: Delta) -> None:
        try:
            seq.sink(delta)
        except Exception:  # NOTE: a broken sink must not stop the loop
            log.exception("sink of request %s failed", seq.request_id)

    def _finish(self, seq: Sequence, publish_rest: bool = True, error: str | None = None) -> None:
        """Free the sequence's blocks and send its final delta (the rest of its output, or
        nothing more when cancelled or failed)."""
        self.scheduler.finish(seq)
        seq.group.num_finished += 1
        if seq.group.done:
            self.stats.latency.append(EngineStats.now() - seq.t_submit)
            self._seqs.pop(seq.request_id, None)
            with self._ids.lock:
                self._ids.release(seq.request_id)
        if publish_rest:
            self._publish(seq, final=True)
            return
        final = Delta(
            seq.request_id,
            [],
            "",
            finish_reason=seq.finish_reason,
            num_input_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_tokens_sent,
            error=error,
            sequence_index=seq.index,
            request_done=seq.group.done,
        )
        self._send(seq, final)

    def _fail_all(self, message: str) -> None:
        for seqs in list(self._seqs.values()):
            for seq in seqs:
                if seq.status is not Status.FINISHED:
                    seq.finish_reason = FinishReason.ERROR
                    self._finish(seq, publish_rest=False, error=message)
