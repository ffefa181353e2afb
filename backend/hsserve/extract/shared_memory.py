"""Hidden rows through Triton system shared memory instead of the gRPC message.

Each stream owns a POSIX shared-memory region registered with the server (the shared-memory API
is one of the restricted ones: it needs the admin key); a request names the region for its
HIDDEN_STATES output, the server writes the rows there and the response carries only their
shape. The region is reused by the stream's next request, so its rows are copied out first; it
grows (re-registered) when a request may need more. Only where client and server share a host.
"""

from __future__ import annotations

import itertools
import os
import time
import urllib.parse

import numpy as np
import torch
from tritonclient.utils import InferenceServerException

from hsserve.triton.server import ADMIN_KEY_ENV, GRPC_ADMIN_HEADER

_names = itertools.count()
_MIN_BYTES = 1 << 20


def local_host(url: str) -> bool:
    """Whether a gRPC HOST:PORT names this machine (a region is visible to the server only then)."""
    host = urllib.parse.urlsplit(f"//{url}").hostname or ""
    return host in ("localhost", "127.0.0.1", "::1")


def admin_key(given: str | None) -> str | None:
    return given or os.environ.get(ADMIN_KEY_ENV) or None


# NOTE: how each HIDDEN_STATES datatype lies in the region (numpy has no bfloat16: its 16-bit words)
_LAYOUT = {"FP32": np.float32, "FP16": np.float16, "BF16": np.uint16}


def to_tensor(array: np.ndarray, bf16: bool) -> torch.Tensor:
    """A copy of `array` as a tensor; bf16: its 16-bit words are bfloat16 values."""
    if bf16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


class OutputRegion:
    """One stream's region for HIDDEN_STATES."""

    def __init__(self, client, key: str):
        import tritonclient.utils.shared_memory as shm

        self.shm, self.client = shm, client
        self.headers = {GRPC_ADMIN_HEADER: key}
        self.name = f"hsserve-extract-{os.getpid()}-{next(_names)}"
        self.handle, self.size = None, 0

    def ensure(self, nbytes: int) -> None:
        """A region of at least nbytes, registered (raises InferenceServerException when the
        server refuses it: wrong key, another host)."""
        if nbytes <= self.size:
            return
        self.close()
        size = max(_MIN_BYTES, 1 << (nbytes - 1).bit_length())
        self.handle = self.shm.create_shared_memory_region(self.name, "/" + self.name, size)
        self.size = size
        self.client.register_system_shared_memory(self.name, "/" + self.name, size,
                                                  headers=self.headers)

    def requested(self, grpc):
        out = grpc.InferRequestedOutput("HIDDEN_STATES")
        out.set_shared_memory(self.name, self.size)
        return out

    def read(self, result) -> torch.Tensor:
        """A copy of the rows the response put in the region."""
        out = result.get_output("HIDDEN_STATES")
        shape = [int(d) for d in out.shape]
        rows = self.shm.get_contents_as_numpy(self.handle, _LAYOUT[out.datatype], shape)
        return to_tensor(rows, out.datatype == "BF16")

    def close(self) -> None:
        """Unregister (retried while the server still holds the region for a request it is
        releasing) and unlink it."""
        if self.handle is None:
            return
        try:
            for attempt in range(50):
                try:
                    self.client.unregister_system_shared_memory(self.name, headers=self.headers)
                    break
                except InferenceServerException as e:
                    if "in use" not in str(e) or attempt == 49:
                        raise
                    time.sleep(0.1)
        finally:
            self.shm.destroy_shared_memory_region(self.handle)
            self.handle, self.size = None, 0
