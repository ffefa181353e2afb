"""Python's garbage collector inside decode runs: how many collections of each generation a
128-token run triggers, how long they stop the loop thread, and the decode step with the objects
alive at start frozen out of the collector (gc.freeze) or not, interleaved in one engine.

    python bench/gc_pauses.py [--batches 1 64] [--repeats 4] [--out ...]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402


class Pauses:
    """gc.callbacks hook: (generation, seconds) of each collection while installed."""

    def __init__(self):
        self.seen: list[tuple[int, float]] = []
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seen.append((info["generation"], time.perf_counter() - self._t))

    def summary(self) -> dict:
        out = {}
        for g in (0, 1, 2):
            ts = [t for gen, t in self.seen if gen == g]
            out[f"gen{g}"] = {"count": len(ts), "total_ms": round(1000 * sum(ts), 3),
                              "max_ms": round(1000 * max(ts, default=0.0), 3)}
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                   "gc_pauses.json"))
    args = ap.parse_args()
    engine = make_engine(random_model(args.shape), max(args.batches))
    pauses = Pauses()
    gc.callbacks.append(pauses)
    rows = []
    try:
        for batch in args.batches:
            engine_run(engine, batch, tag="warm")
            for r in range(args.repeats):
                for frozen in (False, True):
                    gc.collect()
                    if frozen:
                        gc.freeze()
                    pauses.seen.clear()
                    res = engine_run(engine, batch, tag=f"r{r}{frozen}-")
                    gc.unfreeze()
                    row = {"batch": batch, "frozen": frozen, "tracked": len(gc.get_objects()),
                           "step_ms": round(res["step_ms"], 4),
                           "steady_step_ms": round(res["steady_step_ms"], 4), **pauses.summary()}
                    print(row, flush=True)
                    rows.append(row)
    finally:
        gc.callbacks.remove(pauses)
        engine.shutdown()
    write_result(args.out, {"benchmark": "gc_pauses", "shape": args.shape, "rows": rows})


if __name__ == "__main__":
    main()
