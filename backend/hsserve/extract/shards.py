"""Shards of extracted hidden states and their index.

DIR/shard-00000.safetensors, ...: `hidden_states` [rows, hidden * len(layers)], `input_ids`
[rows] int32 (each row's token), `offsets` [records + 1] int64 (record r's rows are
offsets[r]:offsets[r + 1]); metadata "hsserve": JSON of record_ids, layers, mode, dtype, model.
DIR/index.json: the run's arguments and the finished shards (file, record ids, lines, rows).
Each file is written to a temporary name and renamed when complete, so a kill loses at most the
shard being filled, and a rerun resumes after the last finished one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "index.json"


def _write_atomically(path: str, write) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


@dataclass
class ShardWriter:
    folder: str
    args: dict  # what makes a run (refused when a folder holds another's)
    shard_bytes: int
    shards: list[dict] = field(default_factory=list)
    _pending: list[tuple[int, str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _bytes: int = 0

    @classmethod
    def open(cls, folder: str, args: dict, shard_bytes: int) -> ShardWriter:
        """A writer for `folder`, resuming what an earlier run with the same args finished."""
        os.makedirs(folder, exist_ok=True)
        writer = cls(folder, args, shard_bytes)
        path = os.path.join(folder, INDEX)
        if os.path.exists(path):
            with open(path) as f:
                index = json.load(f)
            if index["args"] != args:
                raise ValueError(f"{folder} holds a run with other arguments ({index['args']}); "
                                 "use another --output")
            writer.shards = index["shards"]
        return writer

    @property
    def next_line(self) -> int:
        """The first line no finished shard covers."""
        return self.shards[-1]["last_line"] + 1 if self.shards else 0

    def add(self, line: int, record_id: str, input_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """One record's rows, in record order; a shard is written once it is full."""
        self._pending.append((line, record_id, input_ids, rows))
        self._bytes += rows.numel() * rows.element_size()
        if self._bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self.shards):05d}.safetensors"
        lines = [p[0] for p in self._pending]
        ids = [p[1] for p in self._pending]
        counts = [len(p[3]) for p in self._pending]
        tensors = {
            "hidden_states": torch.cat([p[3] for p in self._pending]).contiguous(),
            "input_ids": torch.cat([p[2] for p in self._pending]).to(torch.int32),
            "offsets": torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int64),
        }
        # NOTE: one metadata entry: safetensors keeps metadata in a hash map, whose order (and so
        # the file's bytes) would differ between processes
        meta = {"hsserve": json.dumps({"record_ids": ids, **self.args}, sort_keys=True)}
        _write_atomically(os.path.join(self.folder, name),
                          lambda p: save_file(tensors, p, metadata=meta))
        self.shards.append({"file": name, "record_ids": ids, "first_line": lines[0],
                            "last_line": lines[-1], "num_records": len(ids),
                            "num_rows": int(sum(counts))})
        self._pending, self._bytes = [], 0
        self._write_index()

    def _write_index(self) -> None:
        body = json.dumps({"args": self.args, "shards": self.shards}, indent=1)

        def write(p: str) -> None:
            with open(p, "w") as f:
                f.write(body)
        _write_atomically(os.path.join(self.folder, INDEX), write)


class Shards:
    """The records of an extraction folder: len(), [i] and iteration give (input_ids, rows) as
    numpy arrays (or torch tensors), read from memory-mapped shards."""

    def __init__(self, folder: str, framework: str = "numpy"):
        with open(os.path.join(folder, INDEX)) as f:
            self.index = json.load(f)
        self.folder, self.framework = folder, framework
        self.record_ids = [r for s in self.index["shards"] for r in s["record_ids"]]
        self._starts = np.cumsum([0] + [s["num_records"] for s in self.index["shards"]])
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        f = self._shard(s)
        offsets = f.get_tensor("offsets")
        r = i - int(self._starts[s])
        a, b = int(offsets[r]), int(offsets[r + 1])
        return f.get_slice("input_ids")[a:b], f.get_slice("hidden_states")[a:b]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _shard(self, s: int):
        if s not in self._open:
            path = os.path.join(self.folder, self.index["shards"][s]["file"])
            self._open[s] = safe_open(path, framework="pt" if self.framework == "torch" else "np")
        return self._open[s]


def open_shards(folder: str, framework: str = "numpy") -> Shards:
    """The records an extraction wrote to `folder` (framework: "numpy" or "torch")."""
    return Shards(folder, framework)
