"""What structured outputs cost: batch-32 decode with every request under a JSON schema vs none.

The engine driven directly, 32 requests at once, greedy. The schema (an array of at least 40
{name, age} objects) never closes within max_tokens, so guided and plain requests generate the
same number of tokens (plain ones with ignore_eos). Decode tok/s = the tokens between a run of
--short and one of --long new tokens over the time between them (prefill cancels out); rounds
interleave guided and plain, the median is reported.
CPU: .venv/bin/python bench/guided_cost.py (SmolLM2-135M, real weights)
GPU: python bench/guided_cost.py --shape llama-1b --tokenizer DIR (random bf16 weights,
SmolLM2's tokenizer: bench/gpu_session.sh guided)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backend"))

from common import write_result  # noqa: E402
from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hsserve.models.default_model import ensure_default_model  # noqa: E402
from hsserve.request import GuidedDecoding  # noqa: E402

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}
TOPICS = ["the staff of a bakery", "a chess club", "a family of five", "a football team",
          "the crew of a ship", "a class of students", "a book club", "a jazz band"]


def batch(engine, n: int, max_tokens: int, guided: bool) -> float:
    g = GuidedDecoding.parse("guided_decoding", {"json": SCHEMA}) if guided else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not guided, guided=g)
    t0 = time.perf_counter()
    streams = [engine.submit(GenerationRequest(
        f"r{i}-{time.monotonic_ns()}", sampling=sp,
        prompt=f"List the people of {TOPICS[i % len(TOPICS)]} (#{i}) as JSON:")) for i in range(n)]
    for s in streams:
        res = s.result(timeout=900)
        assert len(res.token_ids) == max_tokens, (res.finish_reason, res.text)
    return time.perf_counter() - t0


def model_folder(shape: str, tokenizer: str) -> str:
    if not shape:
        return ensure_default_model("")
    from shapes import random_model

    folder = random_model(shape)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer or ensure_default_model(""), f), folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="", help="GPU: a bench/shapes.py shape, random weights")
    ap.add_argument("--tokenizer", default="", help="GPU: a folder with SmolLM2's tokenizer files "
                    "(default: the default model's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=72)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["plain", "guided"], help="for a profile: one")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    gpu = bool(args.shape)
    params = dict(model=model_folder(args.shape, args.tokenizer), max_num_seqs=args.batch,
                  device="cuda" if gpu else "cpu")
    if gpu:
        params.update(load_format="dummy", dtype="bfloat16")
    engine = Engine(EngineConfig(**params)).start()
    batch(engine, args.batch, args.short, True)  # NOTE: warm: the compiler, the schema's cache
    rates: dict[str, list[float]] = {k: [] for k in args.kinds}
    for _ in range(args.rounds):
        for kind in rates:
            short = batch(engine, args.batch, args.short, kind == "guided")
            long = batch(engine, args.batch, args.long, kind == "guided")
            rates[kind].append(args.batch * (args.long - args.short) / (long - short))
    engine.shutdown()
    med = {k: statistics.median(v) for k, v in rates.items()}
    if len(med) == 1:
        print(med)
        return
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"{'gpu' if gpu else 'cpu'}_guided_cost.json")
    write_result(out, {
        "model": f"{args.shape} random bf16" if gpu else "SmolLM2-135M-Instruct float32",
        "batch": args.batch, "new_tokens": [args.short, args.long], "schema": SCHEMA,
        "decode_tok_s": {k: round(v, 1) for k, v in med.items()},
        "rounds_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "guided_over_plain": round(med["guided"] / med["plain"], 3),
        "cost": round(1 - med["guided"] / med["plain"], 3),
    })


if __name__ == "__main__":
    main()
