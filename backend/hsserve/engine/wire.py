"""Messages on the engine process's pipes: pickled, with large arrays (hidden rows) out of band.

A message is a head frame (the count and sizes of its out-of-band buffers, then the pickle) and
one frame per buffer, written from the array's memory and read straight into the receiver's own
array: no copy into or out of a pickle (bench/README.md#rows-across-the-pipe). Pipes are enlarged
where the system allows, so a 12 MB row block crosses in fewer wake-ups.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import struct
import threading

import numpy as np

_F_SETPIPE_SZ = 1031  # NOTE: Linux's fcntl
_PIPE_BYTES = 1 << 20  # NOTE: the unprivileged ceiling by default (/proc/sys/fs/pipe-max-size)


def frames(msg) -> list:
    """The frames of one message (buffers still referencing the message's arrays)."""
    out: list[pickle.PickleBuffer] = []
    head = pickle.dumps(msg, protocol=5, buffer_callback=out.append)
    sizes = [memoryview(b).nbytes for b in out]
    return [struct.pack(f"<I{len(sizes)}Q", len(sizes), *sizes) + head,
            *(memoryview(b).cast("B") for b in out)]


def send(conn, lock: threading.Lock, parts: list) -> None:
    """One message's frames, together (several threads send on each end): the head as a
    Connection message, the buffers as raw bytes (their sizes are in the head)."""
    with lock:
        conn.send_bytes(parts[0])
        for part in parts[1:]:
            view = part
            while len(view):
                view = view[os.write(conn.fileno(), view):]


def post(conn, lock: threading.Lock, msg) -> None:
    send(conn, lock, frames(msg))


def receive(conn):
    """The next message; its arrays own memory read from the pipe."""
    head = conn.recv_bytes()
    (n,) = struct.unpack_from("<I", head)
    sizes = struct.unpack_from(f"<{n}Q", head, 4)
    buffers = []
    for size in sizes:
        buf = np.empty(size, dtype=np.uint8)
        view = memoryview(buf)
        while len(view):  # NOTE: straight into the array (Connection would copy twice)
            got = os.readv(conn.fileno(), [view])
            if got == 0:
                raise EOFError
            view = view[got:]
        buffers.append(buf)
    return pickle.loads(memoryview(head)[4 + 8 * n :], buffers=buffers)


def widen(conn) -> None:
    """Enlarge the pipe under `conn` (either end) where the system allows; else leave it."""
    try:
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass
