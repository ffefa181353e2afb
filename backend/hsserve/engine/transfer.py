"""Host <-> device copies that never make the loop thread wait for the device.

With steps overlapped (the engine queues step t+1 before it reads step t), a copy that blocks
the host (torch.tensor(values, device="cuda"), tensor.cpu()) would wait for everything queued
before it, and the overlap would be gone. These go through pinned host memory, asynchronously;
the caching host allocator keeps a pinned block until the copies that use it are done.
"""

from __future__ import annotations

import torch


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A device tensor of `values`, copied without waiting for the device."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def download(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x`, queued on the current stream: valid once the stream has reached it
    (record an event after it and wait on that)."""
    if x.device.type != "cuda":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return out.copy_(x, non_blocking=True)


def fetch(x: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    """A host copy of `x` made now on `stream`, for data whose step has completed: the steps
    queued after it on the engine's stream are not waited for."""
    if x.device.type != "cuda":
        return x
    with torch.cuda.stream(stream):
        return x.to("cpu")
