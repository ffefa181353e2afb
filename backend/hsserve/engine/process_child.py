"""The engine process's side: the Engine, the parent's commands applied on the main thread, each
loop round's deltas pickled by the loop thread itself (Engine's after_round) and written to the
pipe by a shipper thread, which needs no GIL to write (bench/README.md#engine-process)."""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
from typing import Callable

from hsserve.engine.config import EngineConfig
from hsserve.engine.loop import Engine
from hsserve.engine.setup import freeze_heap
from hsserve.engine.messages import (Abort, Add, ClearCache, Deltas, Died, Failed, FailAll, Ready,
                                     SnapshotTaken, Stop, Stopped, TakeSnapshot, delta_to_wire,
                                     error_delta)
from hsserve.engine.wire import frames, post, receive, send, widen
from hsserve.request import Delta

log = logging.getLogger(__name__)

_STOP = object()


def _portable(e: BaseException) -> BaseException:
    """e if it survives a pickle round trip (the parent re-raises it), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


def child_main(config: EngineConfig, cmd, evt, on_step: Callable[[int], None] | None = None) -> None:
    """The engine process: load, say ready, apply commands until told to stop (or the parent is
    gone), then stop the engine and send what is left."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: the parent decides when to stop
    logging.basicConfig(level=logging.INFO,
                        format="hsserve-engine %(levelname)s %(name)s: %(message)s")
    _Child(config, cmd, evt, on_step).run()


class _Child:
    def __init__(self, config: EngineConfig, cmd, evt, on_step):
        self.cmd, self.evt = cmd, evt
        widen(evt)  # NOTE: the rows' direction
        self.lock = threading.Lock()
        self.deltas: list[Delta] = []  # NOTE: the loop thread's, between two rounds
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # NOTE: for the shipper
        self.engine = Engine(config, after_round=self.ship_round, on_step=on_step)

    def send(self, msg) -> None:
        post(self.evt, self.lock, msg)

    def run(self) -> None:
        if not self._start():
            return
        shipper = threading.Thread(target=self._ship, name="hsserve-shipper", daemon=True)
        shipper.start()
        try:
            self._serve()
        except (EOFError, OSError):
            log.warning("the parent process is gone; stopping the engine")
        finally:
            self.engine.shutdown()
            self.outbox.put(_STOP)
            shipper.join(30)
            try:
                self.send(Stopped())
            except OSError:
                pass

    def _start(self) -> bool:
        try:
            self.engine.start()
        except BaseException as e:  # noqa: BLE001 - handed to the parent's start()
            self.send(Failed(_portable(e)))
            return False
        freeze_heap()  # NOTE: this process serves one engine for its whole life
        try:
            self.send(Ready(self.engine.info))
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that does not pickle
            self.engine.shutdown()
            self.send(Failed(RuntimeError(f"the engine process could not hand over its model: {e!r}")))
            return False
        return True

    def _serve(self) -> None:
        told_died = False
        while True:
            if self.engine.died and not told_died:
                told_died = True
                self.outbox.put(frames(Died(f"the engine stopped: {self.engine.error!r}")))
            if not self.cmd.poll(0.5):
                continue
            msg = receive(self.cmd)
            if isinstance(msg, Stop):
                return
            try:
                self._apply(msg)
            except OSError:
                raise
            except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                log.exception("command %r failed", msg)

    def _apply(self, msg) -> None:
        engine = self.engine
        if isinstance(msg, Add):
            try:
                engine.enqueue(msg.request, sink=self.deltas.append)
            except Exception as e:  # noqa: BLE001 - the engine may have died meanwhile
                wire = [delta_to_wire(error_delta(msg.request.request_id, str(e)))]
                self.outbox.put(frames(Deltas(wire)))
        elif isinstance(msg, Abort):
            engine.abort(msg.request_id)
        elif isinstance(msg, FailAll):
            engine.abort_all(msg.message)
        elif isinstance(msg, ClearCache):
            engine.clear_prefix_cache()
        elif isinstance(msg, TakeSnapshot):
            self.send(SnapshotTaken(engine.snapshot()))
        else:
            log.error("unknown command %r", msg)

    def ship_round(self) -> None:
        """On the loop thread, after each round: its deltas as one message for the shipper."""
        deltas = self.deltas
        if not deltas:
            return
        try:
            # NOTE: rows stay out of the pickle (engine/wire.py): cheap on the loop thread
            self.outbox.put(frames(Deltas([delta_to_wire(d) for d in deltas])))
        except BaseException:  # noqa: BLE001 - deltas lost would leave requests hanging
            log.exception("shipping the engine's deltas failed; ending the engine process")
            os._exit(1)  # NOTE: the parent reads EOF and ends every request in flight
        deltas.clear()

    def _ship(self) -> None:
        """The engine's messages to the parent, in order, until _STOP."""
        try:
            while (item := self.outbox.get()) is not _STOP:
                send(self.evt, self.lock, item)
        except OSError:
            log.warning("the parent process is gone; deltas dropped")
        except BaseException:  # noqa: BLE001 - without the shipper no request would ever end
            log.exception("the delta shipper failed; ending the engine process")
            os._exit(1)  # NOTE: the parent reads EOF and ends every request in flight
