"""Engine: the engine loop on a thread of this process (an EngineClient). submit / abort from any
thread; each request's deltas go to its sink from the loop thread.

A step: schedule -> launch -> complete the previous step (tokens, rows, deltas). With async
scheduling (on CUDA by default) step t+1 is launched before step t is read, for the sequences t
sampled (scheduler.schedule_ahead), so the loop's host work overlaps the device's
(bench/README.md#async-scheduling). Only the loop thread touches scheduler, pool, executor, rows.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from typing import Callable

import torch

from hsserve.engine.admission import Admission, AdmittedRequest, RequestIds, make_sequences
from hsserve.engine.admission import not_serving
from hsserve.engine.client import Sink
from hsserve.engine.config import EngineConfig
from hsserve.engine.messages import Abort, ClearCache, EngineInfo, Enqueued, FailAll, Stop
from hsserve.engine.outputs import Outputs, awaits_compute
from hsserve.engine.request_stream import RequestStream
from hsserve.engine.sequence import Sequence, Status
from hsserve.engine.setup import EngineParts, build_engine_parts
from hsserve.engine.stats import EngineSnapshot, EngineStats
from hsserve.engine.types import Chunk, Launched
from hsserve.request import FinishReason, GenerationRequest

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        build: Callable[[EngineConfig], EngineParts] = build_engine_parts,
        after_round: Callable[[], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ):
        """Nothing is loaded until start(); `build` makes the model, pool and scheduler.
        `after_round`: called on the loop thread after each round of the loop (its messages
        applied, a step run) and once at the end, when the round's deltas are all with their
        sinks. `on_step`: called with the step count after each step (an exception it raises
        ends the loop, as a bug escaping it would: tests use it to kill an engine)."""
        self.config = config
        self._build, self._after_round, self._on_step = build, after_round, on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._seqs: dict[str, list[Sequence]] = {}  # NOTE: loop thread only; request -> its n
        self._ids = RequestIds(config)
        self._arrivals = 0
        self.num_steps = self.num_mixed_steps = self.num_ahead_steps = 0
        self.busy_s = 0.0  # seconds the loop spent in steps (the rest: idle)
        self.stats = EngineStats()
        self._inflight: Launched | None = None  # NOTE: launched, not read yet
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"hsserve-engine-{id(self):x}", daemon=True
        )
        self._started = self._stopped = False
        self._dead = False  # NOTE: the loop thread ended without being asked to

    def _install(self, p: EngineParts) -> None:
        self.spec, self.model, self.tokenizer = p.spec, p.model, p.tokenizer
        self.pool, self.scheduler, self.executor, self.rows = p.pool, p.scheduler, p.executor, p.rows
        self.max_model_len, self.max_prompt_tokens = p.max_model_len, p.max_prompt_tokens
        self.captured_layers = p.captured_layers
        self.device: torch.device = p.executor.device
        mode = self.config.async_scheduling
        self._async = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self.outputs = Outputs(p.scheduler, p.rows, self.stats, frozenset(p.spec.eos_token_ids),
                               self._request_done)
        self.info = EngineInfo(p.spec, p.tokenizer, p.max_model_len, p.max_prompt_tokens,
                               p.captured_layers, str(self.device), self.num_graph_captures)
        self._admission = Admission(self.config, self.info)

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
        """As EngineClient.submit: admission, then the request is queued for the loop."""
        if not self.healthy:
            raise not_serving(self.error, self._dead)
        return self.enqueue(self._admission.admit(request), sink, claim=True)

    def enqueue(self, request: AdmittedRequest, sink: Sink | None = None,
                claim: bool = False) -> Sink:
        """Queue an admitted request (the engine process's child admits nothing a second time;
        its parent claimed the id). EngineUnavailable when the engine is not serving."""
        sink = sink or RequestStream(request.request_id)
        seqs = make_sequences(request, self.tokenizer, self.max_model_len, sink,
                              self._admission.grammars)
        with self._ids.lock:  # NOTE: the loop's end drains the inbox under it: nothing is missed
            closed = self._dead or self._stopped
            if claim:
                self._ids.claim(request.request_id, closed=closed)
            elif closed:
                raise not_serving(self.error, self._dead)
            now = EngineStats.now()
            for seq in seqs:
                self._arrivals += 1
                seq.arrival = self._arrivals
                seq.t_submit = seq.t_last = now
            self._inbox.put(Enqueued(seqs))
        return sink

    def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    def clear_prefix_cache(self) -> None:
        self._inbox.put(ClearCache())

    def abort_all(self, message: str) -> None:
        self._inbox.put(FailAll(message))

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        """Blocking convenience: submit and collect the Result."""
        return self.submit(request).result(timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            self._inbox.put(Stop())
            self._thread.join(timeout)

    @property
    def thread_name(self) -> str:
        return self._thread.name

    @property
    def healthy(self) -> bool:
        return self._started and not self._stopped and not self._dead and self._thread.is_alive()

    @property
    def died(self) -> bool:
        return self._dead

    @property
    def num_graph_captures(self) -> int:
        """CUDA graphs captured (all at start; the number never grows while serving)."""
        graphs = self.executor.graphs if self.executor is not None else None
        return graphs.num_captures if graphs is not None else 0

    def snapshot(self) -> EngineSnapshot:
        return self.stats.snapshot(self.scheduler, self.pool, self.num_graph_captures)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- loop thread: lifecycle ---------------------------------------------------------------

    def _run(self) -> None:
        # NOTE: built on this thread, the one that runs torch compute (bench/README.md#loop-thread)
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
            while self._drain(block=not self._has_work()):
                self.executor.check_ranks()  # NOTE: a lost rank ends the loop, as a crash
                if self._has_work():
                    self._timed_step()
                else:
                    self.pool.check_invariants()
                self._round_done()
            clean = True
        except BaseException as e:  # noqa: BLE001 - the loop died: say why to everyone waiting
            log.exception("engine loop died")
            self.error = e
        finally:
            with self._ids.lock:  # NOTE: enqueue() puts under this lock, so nothing is missed
                self._dead = not clean
                self._drain_unprocessed()
            self._fail_all("the engine shut down" if clean else f"the engine stopped: {self.error!r}")
            self._round_done()
            log.info("engine loop ended after %d steps in %.2f s busy (%d queued ahead, %d mixed), "
                     "%d preemptions", self.num_steps, self.busy_s, self.num_ahead_steps,
                     self.num_mixed_steps, self.scheduler.num_preemptions)
            self._release()

    def _timed_step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._step()
        except Exception as e:  # NOTE: fail what is in flight, keep serving
            self.executor.check_ranks(wait_s=1.0)  # NOTE: unless a rank is gone: then the loop dies
            log.exception("engine step failed")
            self.error = e
            self._abandon_inflight("after a failed step")
            self._fail_all(f"engine step failed: {e!r}")
        self.busy_s += time.perf_counter() - t0
        if self._on_step is not None:
            self._on_step(self.num_steps)

    def _round_done(self) -> None:
        try:
            if self._after_round is not None:
                self._after_round()
        except Exception:  # NOTE: as a broken sink, it must not stop the loop
            log.exception("after_round failed")

    def _abandon_inflight(self, why: str) -> None:
        """Drop the launched step unread, once the device has run it (the graphs' host input
        slots are reused two steps later on the assumption that it did)."""
        if self._inflight is not None:
            self.rows.processed(self._inflight)  # NOTE: its live rows are let go, not kept
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
            if isinstance(msg, Enqueued):
                self._seqs[msg.seqs[0].request_id] = msg.seqs

    def _release(self) -> None:
        """Drop the weights and the KV cache so their memory returns (the pool's ids stay)."""
        self._abandon_inflight("while stopping")
        self.executor.close()  # NOTE: tensor parallel ranks stop with the engine
        self.model = self.executor = None
        if self.device.type == "cuda":
            gc.collect()  # NOTE: CUDA graphs and their memory pool go only when collected
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                torch._C._cuda_clearCublasWorkspaces()  # NOTE: one per stream (capture used its own)
            torch.cuda.empty_cache()

    # ---- loop thread: messages ----------------------------------------------------------------

    def _drain(self, block: bool) -> bool:
        """Apply queued messages; False when asked to stop."""
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while not isinstance(msg, Stop):
            if isinstance(msg, Enqueued):
                self._add(msg.seqs)
            elif isinstance(msg, Abort):
                self._abort(msg.request_id)
            elif isinstance(msg, ClearCache):
                self.pool.clear_cache()
            else:
                self._fail_all(msg.message)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add(self, seqs: list[Sequence]) -> None:
        self._seqs[seqs[0].request_id] = seqs
        self.stats.prompt_tokens += seqs[0].num_prompt_tokens
        for seq in seqs:
            if seq.finish_reason is not None and not awaits_compute(seq):
                self.outputs.finish(seq)  # NOTE: prompt only and nothing asked of a step
            else:
                self.scheduler.add(seq)

    def _abort(self, request_id: str) -> None:
        for seq in self._seqs.get(request_id, []):
            if seq.status is not Status.FINISHED:
                seq.finish_reason = FinishReason.CANCELLED
                self.outputs.finish(seq, publish_rest=False)

    def _fail_all(self, message: str) -> None:
        for seqs in list(self._seqs.values()):
            for seq in seqs:
                if seq.status is not Status.FINISHED:
                    seq.finish_reason = FinishReason.ERROR
                    self.outputs.finish(seq, publish_rest=False, error=message)

    def _request_done(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        with self._ids.lock:
            self._ids.release(request_id)

    # ---- loop thread: the step ----------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    def _step(self) -> None:
        """schedule -> launch -> complete the previous step (which publishes its deltas)."""
        prev, sched = self._inflight, self.scheduler
        chunks = sched.schedule_ahead(prev.chunks, prev.sampled) if prev is not None else None
        if prev is not None and chunks is None:  # NOTE: the scheduler needs prev's tokens first
            self._complete(prev)
            prev = None
        if chunks is None:
            chunks = sched.schedule()
        step = self._launch(chunks, prev) if chunks else None
        if prev is not None:
            self._complete(prev)
            step and self.executor.finish_sampling(step)  # NOTE: guided masks follow prev's tokens
        if step is not None and not self._async:
            self._complete(step)
            step = None
        self._inflight = step

    def _launch(self, chunks: list[Chunk], prev: Launched | None) -> Launched:
        self.rows.settle()  # NOTE: before a replay may rewrite the rows of the last graph step
        step = self.executor.launch(chunks, self.rows.plan(chunks), prev)
        self.rows.launched(step)
        self.num_steps += 1
        self.num_ahead_steps += prev is not None
        decodes = sum(c.num_tokens == 1 for c in chunks)
        self.num_mixed_steps += 0 < decodes < len(chunks)
        return step

    def _complete(self, step: Launched) -> None:
        self.outputs.process(step, self.executor.complete(step))
        self.rows.processed(step)
