"""What a batch-1 decode step adds to its graph on the device's stream (1B shape, random bf16).

The engine queues per step: the host-to-device copy of the step's inputs (ids, positions,
slots, lengths), the graph, the device-to-host copy of the samples, an event. Each copy is a
node on the stream between two graphs. Here the graph is replayed back to back with each of
those added, and with the samples written to pinned host memory by a kernel instead (zero-copy:
a store through the unified address), GPU ms per step by events.

    python bench/step_overhead.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

from hsserve import HiddenStatesMode  # noqa: E402
from hsserve.engine.transfer import download  # noqa: E402


@triton.jit
def _store_kernel(SRC, DST, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(DST + r, tl.load(SRC + r))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "h200_step_overhead.json"))
    args = ap.parse_args()
    engine = make_engine(random_model("llama-1b"), 1, ceiling=HiddenStatesMode.NONE)
    try:
        engine_step = engine_run(engine, 1, tag="warm")["step_ms"]
        g = engine.executor.graphs
        graph = g.graphs[(1, False)]
        host = torch.zeros(1, dtype=torch.long, pin_memory=True)
        # NOTE: a zero-copy store's target must be readable after the step's event
        _store_kernel[(1,)](g.sampled, host, N=1)
        torch.cuda.synchronize()
        assert host[0] == g.sampled[0].item(), "zero-copy store did not reach the host"

        def meta():
            g.meta.copy_(g.host_meta[0], non_blocking=True)

        def d2h():
            download(g.sampled[:1])

        def zero_copy():
            _store_kernel[(1,)](g.sampled, host, N=1)

        variants = {
            "graph": [graph.replay],
            "meta_copy": [meta, graph.replay],
            "d2h_copy": [graph.replay, d2h],
            "both": [meta, graph.replay, d2h],
            "both_event": [meta, graph.replay, d2h, lambda: torch.cuda.Event().record()],
            "zero_copy_kernel": [graph.replay, zero_copy],
            "meta_zero_copy": [meta, graph.replay, zero_copy],
        }
        rows = {}
        for name, parts in variants.items():
            def step(parts=parts):
                for p in parts:
                    p()
            rows[name] = min(event_ms(step, 200, warm=10) for _ in range(3))
            print(f"{name:20s} {rows[name]:.4f} ms  +{1000 * (rows[name] - rows['graph']):.1f} us",
                  flush=True)
        print(f"engine step {engine_step:.4f} ms", flush=True)
    finally:
        engine.shutdown()
    write_result(args.out, {"benchmark": "step_overhead (llama-1b, batch 1, GPU ms per step)",
                            "engine_step_ms": engine_step, "per_step_ms": rows})


if __name__ == "__main__":
    main()
