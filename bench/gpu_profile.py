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
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from gpu_decode import NEW, engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

from hsserve import HiddenStatesMode  # noqa: E402


@contextmanager
def wrapped(methods: dict, around):
    """For the block, each method `key: (obj, name)` runs inside the context manager around(key)."""
    originals = {k: getattr(obj, name) for k, (obj, name) in methods.items()}

    def wrap(key, fn):
        def run(*a, **kw):
            with around(key):
                return fn(*a, **kw)
        return run
    for k, (obj, name) in methods.items():
        setattr(obj, name, wrap(k, originals[k]))
    try:
        yield
    finally:
        for k, (obj, name) in methods.items():
            setattr(obj, name, originals[k])


def host_profile(engine, batch: int, top: int, mode: HiddenStatesMode) -> pstats.Stats:
    """cProfile of the engine's loop thread (installed as that thread's profiler) over one run."""
    engine_run(engine, batch, mode=mode, tag="host-warm")  # NOTE: the mode's first-run costs
    prof = cProfile.Profile()

    @contextmanager
    def profiling(_key):
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
    with wrapped({"step": (engine, "_step")}, profiling):
        r = engine_run(engine, batch, mode=mode, tag="host")
    print(f"\n== host, batch {batch}, MODE={mode.name}: step {r['step_ms']:.3f} ms "
          "(cProfile on: slower than real)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(top)
    return stats


def print_difference(a: pstats.Stats, b: pstats.Stats, names: tuple[str, str], top: int) -> None:
    """Functions by how much more own time (tottime) they took in run b than in run a, per step."""
    def own(st):
        return {f"{fn[0].rsplit('/', 1)[-1]}:{fn[1]}({fn[2]})": (v[1], v[2], v[3])
                for fn, v in st.stats.items()}
    ra, rb = own(a), own(b)
    rows = [(rb.get(k, (0, 0, 0))[1] - ra.get(k, (0, 0, 0))[1], k) for k in set(ra) | set(rb)]
    a_name, b_name = names
    print(f"\n== own time per step, {b_name} minus {a_name} (us; calls {a_name} / {b_name})")
    print(f"total {1e6 * (b.total_tt - a.total_tt) / NEW:+.1f}")
    for d, k in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
        ca, cb = ra.get(k, (0,))[0], rb.get(k, (0,))[0]
        print(f"{1e6 * d / NEW:+9.1f}  {ca:6d} / {cb:6d}  {k[:100]}")


def kernel_profile(engine, shape: str, batch: int, mode: HiddenStatesMode, top: int) -> None:
    """GPU kernels by name over one run (torch profiler), and how busy the GPU was: the union of
    kernel and copy intervals over the span from the first to the last."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = engine_run(engine, batch, mode=mode, tag=f"prof{mode.name}")
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per_name[e.name][0] += 1
            per_name[e.name][1] += e.device_time
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    busy, reach = 0.0, spans[0][0]
    for a, b in spans:
        busy += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    total = sum(v[1] for v in per_name.values())
    print(f"\n== {shape} batch {batch} MODE={mode.name}: step {r['step_ms']:.3f} ms; kernel time "
          f"{total / 1000 / NEW:.3f} ms per step (all kernels incl. prefill / {NEW}); GPU busy "
          f"{busy / (reach - spans[0][0]):.1%} of {(reach - spans[0][0]) / 1000:.1f} ms")
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{us / NEW:9.1f} us/step {count / NEW:7.1f} x  {us / count:8.2f} us  {name[:90]}")


def section_times(engine, batch: int, mode: HiddenStatesMode, runs: int = 3) -> None:
    """Wall time per step of the loop's parts (perf_counter around each; ~1 us of its own): where
    the host's share of a step goes, without cProfile's overhead. Best of `runs` runs."""
    ex = engine.executor
    parts = {"schedule_ahead": (engine.scheduler, "schedule_ahead"),
             "plan_rows": (engine.rows, "plan"), "launch": (ex, "launch"),
             "wait": (ex, "complete"), "outputs": (engine.outputs, "process"),
             "schedule": (engine.scheduler, "schedule")}
    best = None
    for r in range(runs):
        spent = {k: 0.0 for k in parts}

        @contextmanager
        def timing(key, spent=spent):
            t = time.perf_counter()
            try:
                yield
            finally:
                spent[key] += time.perf_counter() - t
        with wrapped(parts, timing):
            res = engine_run(engine, batch, mode=mode, tag=f"sections{r}")
        if best is None or res["step_ms"] < best[0]["step_ms"]:
            best = (res, spent)
    res, spent = best
    line = ", ".join(f"{k} {1e6 * v / NEW:.0f}" for k, v in spent.items())
    print(f"== sections, batch {batch}, MODE={mode.name}: step {res['step_ms']:.3f} ms; "
          f"us per step: {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--sections", action="store_true", help="the loop's parts timed per step")
    ap.add_argument("--modes", nargs="+", default=["none"], help="with --host: MODE none/last/full")
    args = ap.parse_args()
    folder = random_model(args.shape)
    engine = make_engine(folder, max(args.batches))
    try:
        for batch in args.batches:
            engine_run(engine, batch, tag="warm")
            if args.sections:
                for m in args.modes:
                    section_times(engine, batch, HiddenStatesMode[m.upper()])
                continue
            if args.host:
                stats = [host_profile(engine, batch, args.top, HiddenStatesMode[m.upper()])
                         for m in args.modes]
                if len(stats) == 2:
                    print_difference(*stats, tuple(args.modes), args.top)
                continue
            for m in args.modes:
                kernel_profile(engine, args.shape, batch, HiddenStatesMode[m.upper()], args.top)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
