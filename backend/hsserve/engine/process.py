"""EngineProcess: the engine loop in a child process (spawned: CUDA is initialised there only),
behind the EngineClient interface: in tritonserver's Python stub the loop would share one GIL
with the response sender (bench/README.md#engine-process).

Parent (here): admission (errors raised at submit, no round trip), the request ids in flight, and
a receiver thread that hands each request's deltas to its sink. Child (process_child.py): the
Engine. Two pipes carry the typed messages of messages.py (engine/wire.py; hidden rows as raw
bytes in their output dtype, out of the pickle). If the child exits unannounced, every request in
flight ends with an error and `died` turns true, as when an in-process engine's loop dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
from typing import Callable

from hsserve.engine.admission import Admission, RequestIds, not_serving
from hsserve.engine.client import Sink
from hsserve.engine.config import EngineConfig
from hsserve.engine.engine_info import EngineInfo
from hsserve.engine.interpreter import python_executable
from hsserve.engine.messages import (Abort, Add, ClearCache, Deltas, Died, FailAll, Failed,
                                     SnapshotTaken, Stop, Stopped, TakeSnapshot, delta_from_wire,
                                     error_delta)
from hsserve.engine.process_child import child_main
from hsserve.engine.request_stream import RequestStream
from hsserve.engine.wire import post, receive
from hsserve.engine.stats import EngineSnapshot
from hsserve.request import Delta, EngineUnavailable, GenerationRequest

log = logging.getLogger(__name__)

_SNAPSHOT_TIMEOUT_S = 5.0


# ---- parent side -------------------------------------------------------------------------------


class EngineProcess:
    def __init__(self, config: EngineConfig, on_step: Callable[[int], None] | None = None):
        """on_step: handed to the child's Engine (picklable; see Engine)."""
        self.config = config
        self._on_step = on_step
        self.error: BaseException | None = None
        self._ids = RequestIds(config)  # NOTE: its lock also guards _sinks
        self._sinks: dict[str, Sink] = {}
        self._send_lock = threading.Lock()
        self._snapshots: queue.SimpleQueue = queue.SimpleQueue()
        self._snapshot_lock = threading.Lock()
        self._started = self._stopped = self._dead = False
        self._proc = None
        self._receiver: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> EngineProcess:
        """Spawn the child, wait until its engine has loaded; re-raises a load error here."""
        if self._started:
            return self
        self._started = True
        ctx = multiprocessing.get_context("spawn")
        ctx.set_executable(python_executable())
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._evt, evt_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=child_main,
                                 args=(self.config, cmd_recv, evt_send, self._on_step),
                                 name="hsserve-engine", daemon=True)
        self._proc.start()
        cmd_recv.close()  # NOTE: the child's ends; closed here so that a dead child reads as EOF
        evt_send.close()
        try:
            while not self._evt.poll(1.0):  # NOTE: loading
                if not self._proc.is_alive():
                    raise EOFError  # NOTE: as when its end of the pipe closes
            msg = receive(self._evt)
        except (EOFError, OSError):
            self._proc.join(5)
            msg = Failed(RuntimeError(
                f"the engine process exited with code {self._proc.exitcode} while loading"))
        except BaseException:
            self._stopped = True
            self._proc.kill()
            raise
        if isinstance(msg, Failed):
            self._stopped = True
            self._proc.join(30)
            self.error = msg.error
            raise msg.error
        self.info: EngineInfo = msg.info
        self._admission = Admission(self.config, msg.info)
        self._receiver = threading.Thread(target=self._receive, name="hsserve-engine-events",
                                          daemon=True)
        self._receiver.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the child; requests still in flight end with an error delta."""
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        try:
            self._command(Stop())
        except OSError:
            pass
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._proc.join(5)
        if self._proc.is_alive():
            log.warning("the engine process did not stop; killing it")
            self._proc.kill()
            self._proc.join(5)
        self._fail_rest("the engine shut down")

    @property
    def healthy(self) -> bool:
        return (self._started and not self._stopped and not self._dead
                and self._proc is not None and self._proc.is_alive())

    @property
    def died(self) -> bool:
        """The engine stopped without being asked to (its loop died, or its process exited)."""
        return self._dead

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # ---- requests ---------------------------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink | None = None) -> Sink:
        """As Engine.submit: RequestError naming the bad input, EngineUnavailable when full or
        not serving; the request's deltas go to `sink` from the receiver thread."""
        if not self.healthy:
            raise not_serving(self.error, self._dead)
        admitted = self._admission.admit(request)
        sink = sink or RequestStream(request.request_id)
        rid = request.request_id
        with self._ids.lock:
            self._ids.claim(rid, closed=self._dead or self._stopped)
            self._sinks[rid] = sink  # NOTE: before the child can answer
        try:
            # NOTE: outside the ids lock: a full pipe blocks this send until the child reads, and
            # the child may first need the receiver (which takes that lock) to drain its events
            self._command(Add(admitted))
        except Exception as e:
            with self._ids.lock:
                mine = self._sinks.pop(rid, None) is not None
                self._ids.release(rid)
            if not mine:
                return sink  # NOTE: the engine stopped meanwhile and the sink got its error delta
            if isinstance(e, OSError):
                raise EngineUnavailable(f"the engine process is gone: {e!r}") from None
            raise
        return sink

    def abort(self, request_id: str) -> None:
        self._command_quietly(Abort(request_id))

    def abort_all(self, message: str) -> None:
        self._command_quietly(FailAll(message))

    def clear_prefix_cache(self) -> None:
        self._command_quietly(ClearCache())

    def generate(self, request: GenerationRequest, timeout: float | None = None):
        return self.submit(request).result(timeout)

    def snapshot(self) -> EngineSnapshot | None:
        """The child engine's metrics now (None when it does not answer within 5 s)."""
        if not self.healthy:
            return None
        with self._snapshot_lock:
            while True:  # NOTE: a late answer to an earlier call is not this call's
                try:
                    self._snapshots.get_nowait()
                except queue.Empty:
                    break
            self._command_quietly(TakeSnapshot())
            try:
                return self._snapshots.get(timeout=_SNAPSHOT_TIMEOUT_S)  # NOTE: None: it ended
            except queue.Empty:
                return None

    def _command(self, msg) -> None:
        post(self._cmd, self._send_lock, msg)

    def _command_quietly(self, msg) -> None:
        try:
            self._command(msg)
        except OSError:
            pass  # NOTE: the child is gone; the receiver ends what was in flight

    # ---- receiver thread ------------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                msg = receive(self._evt)
                if isinstance(msg, Deltas):
                    self._deliver([delta_from_wire(wire) for wire in msg.wire])
                elif isinstance(msg, SnapshotTaken):
                    self._snapshots.put(msg.snapshot)
                elif isinstance(msg, Died):
                    self.error, self._dead = RuntimeError(msg.message), True
                elif isinstance(msg, Stopped):
                    if not self._stopped:  # NOTE: not asked: the child's command loop failed
                        self.error = RuntimeError("the engine process stopped by itself")
                        self._dead = True
                    return
        except BaseException as e:  # noqa: BLE001 - EOF when the child is gone; anything else too
            if not self._stopped:
                self._proc.join(1)
                code = self._proc.exitcode
                self.error = RuntimeError(
                    f"the engine process exited unexpectedly (code {code})" if code is not None
                    else f"reading the engine process failed: {e!r}")
                self._dead = True
                log.error("%s", self.error)
        finally:
            self._snapshots.put(None)  # NOTE: wakes a snapshot() waiting for an answer
            self._fail_rest(f"the engine stopped: {self.error!r}" if self._dead
                            else "the engine shut down")

    def _deliver(self, deltas: list[Delta]) -> None:
        """One message's deltas to their sinks (the ids lock taken once: ~64 deltas a step)."""
        with self._ids.lock:
            sinks = [self._sinks.get(d.request_id) for d in deltas]
            for d in deltas:
                if d.request_done:
                    self._sinks.pop(d.request_id, None)
                    self._ids.release(d.request_id)
        for d, sink in zip(deltas, sinks):
            if sink is None:
                continue
            try:
                sink(d)
            except Exception:  # noqa: BLE001 - a broken sink must not stop the receiver
                log.exception("sink of request %s failed", d.request_id)

    def _fail_rest(self, message: str) -> None:
        """End every request still in flight with one error delta."""
        with self._ids.lock:
            left = list(self._sinks.items())
            self._sinks.clear()
            for rid, _ in left:
                self._ids.release(rid)
        for rid, sink in left:
            try:
                sink(error_delta(rid, message))
            except Exception:  # noqa: BLE001
                log.exception("sink of request %s failed", rid)


