"""Shared bench helpers: machine description, commit, json output, timing a CUDA graph."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess


def commit() -> str:
    """The code's commit; HSSERVE_COMMIT overrides it (the device machine's copy has no history)."""
    if os.environ.get("HSSERVE_COMMIT"):
        return os.environ["HSSERVE_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "backend"]) != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "isa": torch.backends.cpu.get_cpu_capability(),  # NOTE: what torch's CPU kernels dispatch to
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu"] = names[0]
    except OSError:
        pass
    return info


def write_result(path: str, payload: dict) -> None:
    payload = {
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        **payload,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def event_ms(fn, iters: int, warm: int = 5) -> float:
    """GPU ms per call of fn() (its work queued back to back on the current stream), by events
    around `iters` calls after `warm` calls."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def time_graph(fn, calls: int, replays: int = 5) -> float:
    """us per call of fn(i) (CUDA work only): fn(0) .. fn(calls - 1) captured in one CUDA graph
    (no launch overhead), replayed `replays` times between two events after a warm-up."""
    import torch

    fn(0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / (replays * calls)
