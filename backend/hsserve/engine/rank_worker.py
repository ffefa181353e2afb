"""A tensor parallel rank other than 0 (started by engine/ranks.py): builds its shard of the model
and KV cache as rank 0 builds its own, then runs each step rank 0 orders, until told to stop or
rank 0 is gone (its pipe closes; on Linux the kernel also kills this process with its parent).

    python -m hsserve.engine.rank_worker RANK SIZE STORE_PORT PIPE_FD RANK0_PID
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from hsserve.engine.ranks import START_TIMEOUT_S, StepOrder, chunks_of, process_group
from hsserve.engine.setup import build_shard
from hsserve.models.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """SIGKILL when rank 0 exits, however it exits (Linux); a no-op elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # NOTE: it exited before the call
        os._exit(1)


def follow(executor, conn: Connection) -> None:
    """Each order, as rank 0 launched it; on CUDA at most one step queued ahead of the device
    (a decode graph's host input slots are rewritten two steps later)."""
    before = None
    while (data := conn.recv_bytes()) != b"":
        order: StepOrder = pickle.loads(data)
        if before is not None:
            before.synchronize()
        executor.follow(chunks_of(order), order.sources, order.sampled, order.with_rows)
        if executor.device.type == "cuda":
            before = torch.cuda.Event()
            before.record()


def main(argv: list[str]) -> int:
    rank, size, port, fd, parent = (int(a) for a in argv)
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: rank 0 decides when to stop
    logging.basicConfig(level=logging.INFO,
                        format=f"hsserve-rank{rank} %(levelname)s %(name)s: %(message)s")
    conn = Connection(fd, writable=False)
    config, device_name, folder = pickle.loads(conn.recv_bytes())
    device = torch.device(device_name)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    store.set(f"up{rank}", "1")
    torch.set_grad_enabled(False)
    parallel = TensorParallel(rank, size, process_group(store, rank, size, device))
    shard = build_shard(config, device, folder, parallel)
    try:
        follow(shard.executor, conn)
    except EOFError:
        log.warning("rank 0 is gone; stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
