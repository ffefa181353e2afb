"""A/B of module flags in a real decode graph (batch 1, or `--batch`): one engine, its graph
recaptured with each variant's flags set, replays timed by CUDA events (best of 2 x 100, variants
interleaved `--rounds` times). Random weights.

    python bench/graph_flags_ab.py --variant pdl hsserve.kernels.pdl:_MAX_ROWS=1 \\
        --variant no_pdl hsserve.kernels.pdl:_MAX_ROWS=0 [--shape qwen3-30b-a3b] [--rounds 3]

A flag is a module attribute read at launch, set to a Python literal (an int is cast to the
attribute's type: 0/1 for a bool; a tuple or dict as given; quote it for the shell); the graph is
recaptured with it, so kernels see it. Each replay is the same step (row 0 reads a fixed token),
and each variant's logits are compared with the first's (cosine, same argmax): a variant that
breaks the step shows there. 221d4da's one-token routing inside gate_up was decided with it
(ROUTE_IN_GATE_UP, removed once kept).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402


def _flags(specs: list[str]) -> list[tuple[object, str, object]]:
    out = []
    for spec in specs:
        target, value = spec.split("=", 1)
        module, attr = target.split(":")
        out.append((importlib.import_module(module), attr, ast.literal_eval(value)))
    return out


def pin_input(graphs, token: int = 1) -> None:
    """Row 0 reads a fixed token from the host ids, not the last replay's sample: every replay is
    the same step, so the variants' logits can be compared."""
    graphs.meta[0, 0] = token
    graphs.sources[0] = graphs.buf.shape[1]  # NOTE: buf's row 1 (the ids), column 0


def replay_us(engine, flags, batch: int = 1):
    """(us a replay of the batch's graph, row 0's logits) with the flags set."""
    old = [(m, a, getattr(m, a)) for m, a, _ in flags]
    for m, a, v in flags:
        setattr(m, a, type(getattr(m, a))(v) if isinstance(v, int) else v)
    try:
        graphs = engine.executor.graphs
        graphs.capture([batch], rows=False)  # NOTE: the whole ladder twice takes minutes
        pin_input(graphs)
        us = 1000 * min(event_ms(graphs.graphs[(batch, False)].replay, 100) for _ in range(2))
        return us, graphs.logits[0].clone()
    finally:
        for m, a, v in old:
            setattr(m, a, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--variant", nargs="+", action="append", required=True,
                    help="NAME module:ATTR=LITERAL ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="the graph replayed (its rows those of "
                    "a warm-up run at this batch; row 0's token fixed)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    variants = {v[0]: _flags(v[1:]) for v in args.variant}
    engine = make_engine(random_model(args.shape), args.batch)
    rows: dict[str, float] = {}
    agree: dict[str, dict] = {}
    first = None
    try:
        engine_run(engine, args.batch, tag="warm")
        for _ in range(args.rounds):
            for name, flags in variants.items():
                us, logits = replay_us(engine, flags, args.batch)
                first = logits if first is None else first
                same = {"cosine": round(float(torch.cosine_similarity(logits, first, 0)), 6),
                        "same_argmax": bool(logits.argmax() == first.argmax())}
                rows[name] = round(min(rows.get(name, us), us), 1)
                agree[name] = min(agree.get(name, same), same, key=lambda a: a["cosine"])
                print(json.dumps({"variant": name, "us": round(us, 1), **same}), flush=True)
    finally:
        engine.shutdown()
    write_result(args.out or os.path.join(os.path.dirname(__file__), "results",
                                          f"h200_graph_flags_{args.shape}.json"),
                 {"benchmark": "graph_flags_ab", "shape": args.shape, "batch": args.batch,
                  "variants": {v[0]: v[1:] for v in args.variant}, "replay_us": rows,
                  "logits_vs_first_variant": agree})


if __name__ == "__main__":
    main()
