"""GPU: a verify step (k drafts checked in one forward) vs a plain decode step, and an EAGLE-3
head's end-to-end cost, random weights in real shapes (issue 44, item 6).

A proposer that always drafts k tokens (repeats of the last token; the target rejects nearly all)
makes every decode step a verify step of k + 1 rows: its step_ms (gpu_decode.py's measure) over
the same engine's without a proposer is the verify step's cost (both through the CUDA graphs). Then batch 1 with a random EAGLE-3
head (acceptance ~0 on random weights: what the head costs before it is accepted), tokens a step
and drafts reported. Run on the GPU machine:

    python bench/gpu_spec_verify.py [--shape llama-8b] [--batches 1 16] [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from common import write_result  # noqa: E402
from gpu_decode import best_of, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

from hsserve import Engine, EngineConfig  # noqa: E402


class AlwaysDraft:
    """k drafts every step: the last token repeated (a verify step's cost, whatever is kept)."""

    lookahead = 0

    def __init__(self, k: int):
        self.k = k

    def propose_for(self, seq, limit: int) -> tuple[int, ...]:
        return (seq.token_ids[-1],) * min(self.k, limit)


def step(engine, batch: int, repeats: int) -> dict:
    steps0, run = engine.num_steps, best_of(engine, batch, repeats)
    r = next(iter(run.values()))
    return dict(step_ms=round(r["step_ms"], 4), tok_s=round(r["tok_s"], 1),
                steps=engine.num_steps - steps0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-8b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "h200_spec_decode.json"))
    args = ap.parse_args()
    folder = random_model(args.shape)
    rows = []
    for batch in args.batches:
        # NOTE: configured for drafts (the graphs then hold verify steps), measured plain first
        engine = make_engine(folder, batch, speculative_method="ngram",
                             num_speculative_tokens=args.k)
        try:
            engine.scheduler.proposer = None
            plain = step(engine, batch, args.repeats)
            engine.scheduler.proposer = AlwaysDraft(args.k)
            verify = step(engine, batch, args.repeats)
        finally:
            engine.shutdown()
        rows.append(dict(shape=args.shape, batch=batch, k=args.k, plain_step_ms=plain["step_ms"],
                         verify_step_ms=verify["step_ms"],
                         verify_over_plain=round(verify["step_ms"] / plain["step_ms"], 3)))
        print(rows[-1], flush=True)
    from eagle3_heads import write_head

    head = write_head(tempfile.mkdtemp(), folder, std=0.02, draft_vocab=list(range(32000)))
    k3 = max(1, min(args.k, 3))
    engine = Engine(EngineConfig(model=folder, device="cuda", load_format="dummy",
                                 dtype="bfloat16", max_num_seqs=1, max_model_len=512,
                                 speculative_method="eagle3", num_speculative_tokens=k3,
                                 speculative_model=head)).start()
    try:
        e = step(engine, 1, args.repeats)
        e.pop("steps")
        e.update(drafted=engine.stats.draft_tokens, accepted=engine.stats.accepted_tokens)
    finally:
        engine.shutdown()
    eagle = dict(shape=args.shape, batch=1, k=k3, **e,
                 over_plain=round(e["step_ms"] / rows[0]["plain_step_ms"], 3))
    print(eagle, flush=True)
    write_result(args.out, dict(rows=rows, eagle3_random_head=eagle,
                                note="verify: every step k drafts, nearly all rejected; "
                                     "eagle3: a random head, acceptance ~0"))


if __name__ == "__main__":
    main()
