"""Engine tokens/s vs transformers generate, same model, same machine, same run.

Default: SmolLM2-135M float32 on the CPU, batch 1 / 8 / 32, 64-token prompts, 64 new tokens
(EOS ignored so every request makes exactly 64). Throughput = batch * new tokens / wall time
from submit to the last token (prefill included), median of --repeats.

transformers runs in a child process: two threads that both run torch's OpenMP regions in one
process slow each other down on a 2-core machine, which would skew either side. The two sides
take turns, one engine run then one transformers run of the same batch size, so that a VM whose
speed drifts over minutes (ours do) shifts both sides alike; each pair's ratio is kept too.

    python bench/engine_vs_hf_cpu.py [--batches 1 8 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams  # noqa: E402
from hsserve.engine.setup import freeze_heap, model_folder  # noqa: E402


def prompts(batch: int, length: int, vocab: int, repeat: int = 0) -> list[list[int]]:
    """Random prompts; each repeat gets its own, so the engine's prefix cache never serves a
    prompt that an earlier repeat computed (transformers has no such cache)."""
    g = torch.Generator().manual_seed(batch * 1000 + repeat)
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


def hf_part(args) -> None:
    """Child process: runs transformers generate on the prompts each stdin line names
    ("batch [repeat]": prompts(batch, ..., repeat)) and prints its tok/s, until stdin closes."""
    from transformers import AutoModelForCausalLM

    folder = model_folder(EngineConfig(model=args.model))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    hf_run(hf, prompts(2, args.prompt_len, vocab), 8)
    print("HF_READY", flush=True)
    for line in sys.stdin:
        b, r = (int(x) for x in (line.split() + ["0"])[:2])  # "batch [repeat]"
        print(f"HF_RESULT {hf_run(hf, prompts(b, args.prompt_len, vocab, r), args.new)}",
              flush=True)


class HFChild:
    """The transformers side in its own process, one run per call."""

    def __init__(self, args):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--hf-only", "--model", args.model, "--prompt-len",
             str(args.prompt_len), "--new", str(args.new)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read("HF_READY")

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"transformers child ended (exit {self.proc.wait()})")

    def run(self, batch: int, repeat: int = 0) -> float:
        """tok/s of one run on `prompts(batch, ..., repeat)`."""
        self.proc.stdin.write(f"{batch} {repeat}\n")
        self.proc.stdin.flush()
        return float(self._read("HF_RESULT"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def measure(args) -> tuple[dict[int, list[tuple[float, float]]], Engine]:
    """Per batch size, --repeats pairs (engine tok/s, transformers tok/s) run back to back."""
    config = EngineConfig(model=args.model, device="cpu", dtype="float32",
                          max_num_seqs=max(args.batches))
    engine = Engine(config).start()
    freeze_heap()  # NOTE: as the serving processes do after start-up
    hf = HFChild(args)
    vocab = engine.spec.vocab_size
    try:
        engine_run(engine, prompts(2, args.prompt_len, vocab), 8, "warm")
        pairs: dict[int, list[tuple[float, float]]] = {}
        for b in args.batches:
            pairs[b] = []
            for r in range(args.repeats):
                ours = engine_run(engine, prompts(b, args.prompt_len, vocab, r), args.new,
                                  f"b{b}r{r}-")
                pairs[b].append((ours, hf.run(b, r)))
                print(f"batch {b} repeat {r}: engine {ours:.1f} tok/s, transformers "
                      f"{pairs[b][-1][1]:.1f}", flush=True)
    finally:
        hf.close()
        engine.shutdown()
    return pairs, engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_engine.json"))
    args = ap.parse_args()
    if args.hf_only:
        hf_part(args)
        return
    pairs, engine = measure(args)
    rows = []
    for b in args.batches:
        ours = statistics.median(e for e, _ in pairs[b])
        theirs = statistics.median(h for _, h in pairs[b])
        rows.append({
            "batch": b,
            "engine_tok_s": round(ours, 1),
            "transformers_tok_s": round(theirs, 1),
            "speedup": round(ours / theirs, 2),
            "pair_speedups": [round(e / h, 2) for e, h in pairs[b]],
        })
    spec = engine.spec
    write_result(args.out, {
        "benchmark": "engine_vs_transformers_generate",
        "model": "SmolLM2-135M-Instruct" if args.model == "default" else args.model,
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
