"""Tensor parallel ranks, rank 0's side: the engine's process is rank 0 (scheduler, sampling,
hidden rows); ranks 1.. are processes of its own (engine/rank_worker.py), each holding a shard
of the model and of the KV cache. Before each step rank 0 sends them the step's order (its
chunks' positions, input tokens and block tables) on a pipe; every rank then runs the same
forward, meeting in the model's collectives (models/tensor_parallel.py).

Started as plain subprocesses (the engine process is a daemonic multiprocessing child, which may
not have children of its own) that die with rank 0 (PR_SET_PDEATHSIG). A rank that exits is
noticed by a watcher thread: the engine then fails the way a crashed engine does (RankLost).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from hsserve.engine.config import ConfigError, EngineConfig
from hsserve.engine.interpreter import python_executable
from hsserve.engine.types import Chunk
from hsserve.models.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # NOTE: the ranks load their shards meanwhile (a 70B model: minutes)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_STOP = b""


class RankLost(RuntimeError):
    """A tensor parallel rank exited: the engine cannot compute another step."""


@dataclass(frozen=True)
class StepOrder:
    """What the other ranks need of a step rank 0 launches: per chunk (start, num_tokens, ahead,
    input tokens or None when ahead, block table, draft length, prompt span), the rows' sources,
    which chunks sample, and whether a decode graph keeps rows (the graph with rows is replayed
    on every rank)."""

    chunks: list[tuple[int, int, bool, list[int] | None, list[int], int,
                       tuple[int, int, int] | None]]
    sources: list[int]
    sampled: list[bool]
    with_rows: bool


class _Window:
    """A sequence's tokens as a rank sees them: only those of this step, at their positions."""

    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.ids[k.start - self.start : k.stop - self.start]
        return self.ids[k - self.start]


class _Seq:
    __slots__ = ("token_ids", "block_table")

    def __init__(self, token_ids: _Window, block_table: list[int]):
        self.token_ids, self.block_table = token_ids, block_table


def order_of(chunks: list[Chunk], sources: list[int], sampled: list[bool],
             with_rows: bool) -> StepOrder:
    return StepOrder([(c.start, c.num_tokens, c.ahead, None if c.ahead else c.input_ids(),
                       c.seq.block_table, len(c.draft), c.prompt_span) for c in chunks],
                     sources, sampled, with_rows)


def chunks_of(order: StepOrder) -> list[Chunk]:
    """The order's chunks, shaped as the executor reads them."""
    return [Chunk(_Seq(_Window(start, ids or []), table), start, n, ahead,
                  draft=tuple(ids[n - k :]) if k else (), prompt_span=span)
            for start, n, ahead, ids, table, k, span in order.chunks]


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Rank r's device: the engine's on the CPU; on CUDA the r-th after the engine's GPU."""
    if device.type != "cuda":
        return [device] * size
    base = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if base + size > count:
        raise ConfigError(f"tensor_parallel_size: {size} needs GPUs cuda:{base}..cuda:"
                          f"{base + size - 1}; this machine has {count}")
    return [torch.device("cuda", base + r) for r in range(size)]


def process_group(store, rank: int, size: int, device: torch.device):
    """The ranks' group: NCCL between GPUs (capturable in CUDA graphs), gloo on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)


class Ranks:
    """Ranks 1..size-1 of one engine: started, told each step, watched, stopped."""

    def __init__(self, config: EngineConfig, device: torch.device, folder: str):
        size = config.tensor_parallel_size
        self.devices = rank_devices(device, size)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self.lost: str | None = None
        self._closing = False
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            for r in range(1, size):
                read, write = os.pipe()
                self._procs.append(subprocess.Popen(
                    [python_executable(), "-m", "hsserve.engine.rank_worker", str(r), str(size),
                     str(store.port), str(read), str(os.getpid())], pass_fds=(read,), env=env))
                os.close(read)
                conn = Connection(write, readable=False)
                conn.send_bytes(pickle.dumps((config, str(self.devices[r]), folder)))
                self._conns.append(conn)
            for r, proc in enumerate(self._procs, start=1):
                self._wait_up(store, r, proc)
            self.parallel = TensorParallel(0, size, process_group(store, 0, size, self.devices[0]))
        except BaseException:
            self.close()
            raise
        self._store = store  # NOTE: kept: the ranks' group rendezvoused through it
        for r, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(r, proc), daemon=True,
                             name=f"hsserve-rank{r}-watch").start()

    @staticmethod
    def _wait_up(store, rank: int, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check([f"up{rank}"]):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor parallel rank {rank} exited with code "
                                   f"{proc.returncode} while starting (see its log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel rank {rank} did not start in "
                                   f"{START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing and self.lost is None:
            self.lost = f"tensor parallel rank {rank} exited with code {code}"
            log.error("%s; the engine stops", self.lost)

    def send(self, chunks: list[Chunk], sources: list[int], sampled: list[bool],
             with_rows: bool) -> None:
        """The step's order to every other rank (before rank 0 launches it)."""
        data = pickle.dumps(order_of(chunks, sources, sampled, with_rows),
                            protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(data)
        except OSError as e:
            raise RankLost(self.lost or f"a tensor parallel rank is gone: {e!r}") from e

    def check(self, wait_s: float = 0.0) -> None:
        """RankLost if a rank exited (waiting up to wait_s for the watcher to tell: a failed
        collective may come before it)."""
        deadline = time.monotonic() + wait_s
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.lost is not None:
            raise RankLost(self.lost)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank (told, then killed after `timeout`); idempotent."""
        self._closing = True
        for conn in self._conns:
            try:
                conn.send_bytes(_STOP)
                conn.close()
            except OSError:
                pass
        self._conns = []
        for proc in self._procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tensor parallel rank pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait(5)
