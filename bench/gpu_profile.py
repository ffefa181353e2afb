"""Where a decode step's time goes, for the Llama-3.2-1B shape with random weights, at the batch
sizes given, over one 128-token run: GPU kernels by name (torch profiler, CUDA graphs included),
or with --host the engine loop thread's Python (cProfile), which is what a step adds to the graph.

    python bench/gpu_profile.py [--batches 1 64] [--shape llama-1b] [--host]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import NEW, engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

from hsserve import HiddenStatesMode  # noqa: E402


def host_profile(engine, batch: int, top: int, mode: HiddenStatesMode) -> None:
    """cProfile of the engine's loop thread (installed as that thread's profiler) over one run."""
    prof = cProfile.Profile()
    step = engine._step
    engine._step = _profiled(step, prof)
    r = engine_run(engine, batch, mode=mode, tag="host")
    engine._step = step
    print(f"\n== host, batch {batch}, MODE={mode.name}: step {r['step_ms']:.3f} ms "
          "(cProfile on: slower than real)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _profiled(fn, prof):
    def run(*a, **kw):
        prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--modes", nargs="+", default=["none"], help="with --host: MODE none/last/full")
    args = ap.parse_args()
    folder = random_model(args.shape)
    engine = make_engine(folder, max(args.batches))
    try:
        for batch in args.batches:
            engine_run(engine, batch, tag="warm")
            if args.host:
                for mode in args.modes:
                    host_profile(engine, batch, args.top, HiddenStatesMode[mode.upper()])
                continue
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                r = engine_run(engine, batch, tag="prof")
            per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
                    per_name[e.name][0] += 1
                    per_name[e.name][1] += e.device_time
            total = sum(v[1] for v in per_name.values())
            print(f"\n== {args.shape} batch {batch}: step {r['step_ms']:.3f} ms; kernel time "
                  f"{total / 1000 / NEW:.3f} ms per step (all kernels incl. prefill / {NEW})")
            for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"{us / NEW:9.1f} us/step {count / NEW:7.1f} x  {us / count:8.2f} us  {name[:90]}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
