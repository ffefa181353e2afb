"""EngineProcess: the Engine in a child process, behind the Engine's client API.

In tritonserver's Python stub the engine's loop thread shares one GIL with the response sender and
the stub's own threads. Measured on the H200 (py-spy of the stub, 64 streams): the loop held the
GIL 53% of the time and otherwise waited for it; a decode step took ~3.2 ms in the stub against
1.4 ms for the engine alone. Here the loop runs in a process of its own (spawned: CUDA is
initialised there only) and has its GIL to itself.

Parent (the stub): admission (the same checks and errors as Engine.submit, raised at submit, no
round trip), the request ids in flight, and a receiver thread that turns the child's batches into
Deltas for each request's sink. Child: the Engine; its main thread applies the parent's commands.
The loop thread itself turns each round's deltas into one pickled message (Engine's after_round);
a shipper thread only writes the messages to the pipe, which needs no GIL: a second Python
thread converting deltas took the GIL from the loop every step (at 64 streams on the H200 the
engine process ran 5-14% below the engine alone; after, -7% to +3% in three runs, -11% in one).

Two pipes carry standard pickles (hidden rows as raw bytes: no shared-memory tensors, no fds):
  parent -> child  ("add", request) ("abort", id) ("fail_all", message) ("clear_cache", None)
                   ("snapshot", None) ("stop", None)
  child -> parent  ("ready", info) or ("failed", error), once; then ("deltas", [wire deltas]),
                   ("snapshot", EngineSnapshot), ("died", message); ("stopped", None) last.
If the child exits unannounced (killed, crashed), every request in flight ends with an error and
`died` turns true, as when an in-process engine's loop dies.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading

import torch

from hsserve.engine.admission import Admission, RequestIds, not_serving
from hsserve.engine.config import EngineConfig
from hsserve.engine.loop import Engine, Sink
from hsserve.request import Delta, EngineUnavailable, FinishReason, GenerationRequest
from hsserve.engine.request_stream import RequestStream
from hsserve.engine.stats import EngineSnapshot

log = logging.getLogger(__name__)

_STOP = object()
_SNAPSHOT_TIMEOUT_S = 5.0


# ---- deltas on the wire ------------------------------------------------------------------------


def delta_to_wire(d: Delta) -> tuple:
    """A Delta as a tuple of plain values (rows as (dtype, shape, bytes)): cheap to pickle."""
    hidden = None
    if d.hidden is not None:
        h = d.hidden.contiguous()
        hidden = (str(h.dtype).removeprefix("torch."), tuple(h.shape), h.view(-1).view(torch.uint8).numpy())
    reason = d.finish_reason.value if d.finish_reason is not None else None
    return (d.request_id, d.token_ids, d.text, hidden, reason, d.num_input_tokens,
            d.num_output_tokens, d.error, d.sequence_index, d.request_done)


def delta_from_wire(w: tuple) -> Delta:
    rid, tokens, text, hidden, reason, n_in, n_out, error, index, done = w
    if hidden is not None:
        dtype, shape, raw = hidden
        hidden = torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)
    return Delta(rid, tokens, text, hidden, FinishReason(reason) if reason is not None else None,
                 n_in, n_out, error, index, done)


def error_delta(request_id: str, message: str) -> Delta:
    """The one final delta of a request that the engine process could not serve."""
    return Delta(request_id, [], "", finish_reason=FinishReason.ERROR, error=message,
                 request_done=True)


def _message(kind: str, arg) -> bytes:
    return pickle.dumps((kind, arg), protocol=pickle.HIGHEST_PROTOCOL)


def _post(conn, lock: threading.Lock, kind: str, arg) -> None:
    """One message (kind, arg) on a pipe, whole: several threads send on each end."""
    _send_bytes(conn, lock, _message(kind, arg))


def _send_bytes(conn, lock: threading.Lock, data: bytes) -> None:
    with lock:
        conn.send_bytes(data)


def _python_executable() -> str:
    """The interpreter for the child: the stub's sys.executable may be the stub binary itself."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    for name in ("python3", "python"):
        path = os.path.join(sys.exec_prefix, "bin", name)
        if os.path.exists(path):
            return path
    raise RuntimeError(f"no Python interpreter for the engine process (sys.executable {exe!r}, "
                       f"sys.exec_prefix {sys.exec_prefix!r}); set engine_process to false")


# ---- parent side -------------------------------------------------------------------------------


class EngineProcess:
    def __init__(self, config: EngineConfig):
        self.config = config
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
        ctx.set_executable(_python_executable())
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._evt, evt_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=child_main, args=(self.config, cmd_recv, evt_send),
                                 name="hsserve-engine", daemon=True)
        self._proc.start()
        cmd_recv.close()  # NOTE: the child's ends; closed here so that a dead child reads as EOF
        evt_send.close()
        try:
            while not self._evt.poll(1.0):  # NOTE: loading
                if not self._proc.is_alive():
                    raise EOFError  # NOTE: as when its end of the pipe closes
            kind, arg = pickle.loads(self._evt.recv_bytes())
        except (EOFError, OSError):
            self._proc.join(5)
            kind, arg = "failed", RuntimeError(
                f"the engine process exited with code {self._proc.exitcode} while loading")
        except BaseException:
            self._stopped = True
            self._proc.kill()
            raise
        if kind == "failed":
            self._stopped = True
            self._proc.join(30)
            self.error = arg
            raise arg
        self.spec, self.max_model_len = arg["spec"], arg["max_model_len"]
        self.captured_layers, self.device = arg["captured_layers"], torch.device(arg["device"])
        self.num_graph_captures = arg["graph_captures"]
        self._admission = Admission(self.config, arg["spec"], arg["tokenizer"], arg["max_model_len"],
                                    arg["max_prompt_tokens"], arg["captured_layers"])
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
            self._command("stop", None)
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
        ids, _, _ = self._admission.check(request)
        sink = sink or RequestStream(request.request_id)
        wire = dataclasses.replace(request, prompt=None, prompt_ids=ids)  # NOTE: tokenized once
        rid = request.request_id
        with self._ids.lock:
            self._ids.claim(rid, closed=self._dead or self._stopped)
            self._sinks[rid] = sink  # NOTE: before the child can answer
        try:
            # NOTE: outside the ids lock: a full pipe blocks this send until the child reads, and
            # the child may first need the receiver (which takes that lock) to drain its events
            self._command("add", wire)
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
        self._command_quietly("abort", request_id)

    def abort_all(self, message: str) -> None:
        self._command_quietly("fail_all", message)

    def clear_prefix_cache(self) -> None:
        self._command_quietly("clear_cache", None)

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
            self._command_quietly("snapshot", None)
            try:
                return self._snapshots.get(timeout=_SNAPSHOT_TIMEOUT_S)  # NOTE: None: it ended
            except queue.Empty:
                return None

    def _command(self, kind: str, arg) -> None:
        _post(self._cmd, self._send_lock, kind, arg)

    def _command_quietly(self, kind: str, arg) -> None:
        try:
            self._command(kind, arg)
        except OSError:
            pass  # NOTE: the child is gone; the receiver ends what was in flight

    # ---- receiver thread ------------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while True:
                kind, arg = pickle.loads(self._evt.recv_bytes())
                if kind == "deltas":
                    self._deliver([delta_from_wire(wire) for wire in arg])
                elif kind == "snapshot":
                    self._snapshots.put(arg)
                elif kind == "died":
                    self.error, self._dead = RuntimeError(arg), True
                elif kind == "stopped":
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


# ---- child side --------------------------------------------------------------------------------


def child_main(config: EngineConfig, cmd, evt) -> None:
    """The engine process: load, say ready, apply commands until told to stop (or the parent is
    gone), then stop the engine and send what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: the parent decides when to stop
    logging.basicConfig(level=logging.INFO, format="hsserve-engine %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(kind: str, arg) -> None:
        _post(evt, send_lock, kind, arg)

    deltas: list[Delta] = []  # NOTE: the loop thread's, between two rounds
    outbox: queue.SimpleQueue = queue.SimpleQueue()  # NOTE: messages for the shipper

    def collect(d: Delta) -> None:  # NOTE: every request's sink, on the loop thread
        deltas.append(d)

    def ship_round() -> None:  # NOTE: on the loop thread, after each round
        if not deltas:
            return
        try:
            batch = [delta_to_wire(d) for d in deltas]
            # NOTE: pickled here, but a round with hidden rows (a copy of every row's bytes) is
            # pickled by the shipper, as the loop may meanwhile wait on the device
            rows = any(d.hidden is not None for d in deltas)
            outbox.put(("deltas", batch) if rows else _message("deltas", batch))
        except BaseException:  # noqa: BLE001 - as in the shipper: deltas lost would hang requests
            log.exception("shipping the engine's deltas failed; ending the engine process")
            os._exit(1)  # NOTE: the parent reads EOF and ends every request in flight
        deltas.clear()

    engine = Engine(config, after_round=ship_round)
    try:
        engine.start()
    except BaseException as e:  # noqa: BLE001 - handed to the parent's start()
        send("failed", _portable(e))
        return
    info = {
        "spec": engine.spec, "tokenizer": engine.tokenizer, "max_model_len": engine.max_model_len,
        "max_prompt_tokens": engine.max_prompt_tokens, "captured_layers": engine.captured_layers,
        "device": str(engine.device), "graph_captures": engine.num_graph_captures,
    }
    try:
        send("ready", info)
    except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that does not pickle
        engine.shutdown()
        send("failed", RuntimeError(f"the engine process could not hand over its model: {e!r}"))
        return
    shipper = threading.Thread(target=_ship, args=(outbox, evt, send_lock), name="hsserve-shipper",
                               daemon=True)
    shipper.start()
    told_died = False
    try:
        while True:
            if engine.died and not told_died:
                told_died = True
                outbox.put(_message("died", f"the engine stopped: {engine.error!r}"))
            if not cmd.poll(0.5):
                continue
            kind, arg = pickle.loads(cmd.recv_bytes())
            if kind == "stop":
                break
            try:
                _apply(engine, kind, arg, collect, outbox, send)
            except OSError:
                raise
            except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                log.exception("command %r failed", kind)
    except (EOFError, OSError):
        log.warning("the parent process is gone; stopping the engine")
    finally:
        engine.shutdown()
        outbox.put(_STOP)
        shipper.join(30)
        try:
            send("stopped", None)
        except OSError:
            pass


def _portable(e: BaseException) -> BaseException:
    """e if it survives a pickle round trip (the parent re-raises it), else a RuntimeError
    naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def _apply(engine: Engine, kind: str, arg, sink, outbox: queue.SimpleQueue, send) -> None:
    if kind == "add":
        try:
            engine.submit(arg, sink=sink)
        except Exception as e:  # noqa: BLE001 - the parent checked it; the engine may have died
            outbox.put(_message("deltas", [delta_to_wire(error_delta(arg.request_id, str(e)))]))
    elif kind == "abort":
        engine.abort(arg)
    elif kind == "fail_all":
        engine.abort_all(arg)
    elif kind == "clear_cache":
        engine.clear_prefix_cache()
    elif kind == "snapshot":
        send("snapshot", engine.snapshot())
    else:
        log.error("unknown command %r", kind)


def _ship(outbox: queue.SimpleQueue, evt, lock: threading.Lock) -> None:
    """The engine's messages to the parent, in order, until _STOP: pickled already, or a
    (kind, arg) to pickle here."""
    try:
        while (item := outbox.get()) is not _STOP:
            _send_bytes(evt, lock, item if isinstance(item, bytes) else _message(*item))
    except OSError:
        log.warning("the parent process is gone; deltas dropped")
    except BaseException:  # noqa: BLE001 - without the shipper no request would ever end
        log.exception("the delta shipper failed; ending the engine process")
        os._exit(1)  # NOTE: the parent reads EOF and ends every request in flight
