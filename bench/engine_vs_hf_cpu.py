"""Engine tokens/s vs transformers generate, same model, same machine, same run.

Default: SmolLM2-135M float32 on the CPU, batch 1 / 8 / 32, 64-token prompts, 64 new tokens
(EOS ignored so every request makes exactly 64). Throughput = batch * new tokens / wall time
from submit to the last token (prefill included), median of --repeats.

    python bench/engine_vs_hf_cpu.py [--batches 1 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hsserve.engine_setup import model_folder  # noqa: E402


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, vocab - 100, (batch, length), generator=g).tolist()


def engine_run(engine: Engine, batch: list[list[int]], new: int, tag: str) -> float:
    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    streams = [engine.submit(GenerationRequest(f"{tag}{i}", prompt_ids=p, sampling=sp))
               for i, p in enumerate(batch)]
    results = [s.result() for s in streams]
    dt = time.perf_counter() - t0
    assert all(len(r.token_ids) == new for r in results)
    return len(batch) * new / dt


@torch.inference_mode()
def hf_run(model, batch: list[list[int]], new: int) -> float:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return len(batch) * new / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_engine.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    config = EngineConfig(model=args.model, device="cpu", dtype="float32", max_num_seqs=max(args.batches))
    engine = Engine(config).start()
    folder = model_folder(config)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    spec = engine.spec
    rows = []
    try:
        engine_run(engine, prompts(2, args.prompt_len, spec.vocab_size), 8, "warm")
        hf_run(hf, prompts(2, args.prompt_len, spec.vocab_size), 8)
        for b in args.batches:
            batch = prompts(b, args.prompt_len, spec.vocab_size)
            ours = [engine_run(engine, batch, args.new, f"b{b}r{r}-") for r in range(args.repeats)]
            theirs = [hf_run(hf, batch, args.new) for _ in range(args.repeats)]
            row = {
                "batch": b,
                "engine_tok_s": round(statistics.median(ours), 1),
                "transformers_tok_s": round(statistics.median(theirs), 1),
            }
            row["speedup"] = round(row["engine_tok_s"] / row["transformers_tok_s"], 2)
            rows.append(row)
            print(row, flush=True)
    finally:
        engine.shutdown()
    write_result(args.out, {
        "benchmark": "engine_vs_transformers_generate",
        "model": folder,
        "model_shape": {"layers": spec.num_layers, "hidden": spec.hidden_size,
                        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "vocab": spec.vocab_size},
        "dtype": "float32",
        "prompt_len": args.prompt_len,
        "new_tokens": args.new,
        "repeats": args.repeats,
        "rows": rows,
    })
    print("| batch | engine tok/s | transformers tok/s | speedup |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['engine_tok_s']} | {r['transformers_tok_s']} | {r['speedup']}x |")


if __name__ == "__main__":
    main()
