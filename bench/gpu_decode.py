"""GPU decode benchmark (H200): engine vs roofline vs transformers, random weights in real shapes.

For each shape and batch size, B requests with 128-token prompts generate 128 tokens each (EOS
ignored), all in lockstep: decode step = time from the last first token to the last token / 127;
throughput = B x 128 / wall time (prefill included). The roofline of a step is the bytes it must
read (every weight once + the KV cache of the batch) / the copy bandwidth measured in the same run.
transformers generate (eager attention cache and its static cache) runs the same shapes after.
MODE costs at batch 64: MODE=last vs none, and MODE=none on a server whose ceiling is full vs one
whose ceiling is none. steady_step_ms: the step in the middle of a run (output tokens 16 to 112),
without the start, and without the end where MODE=last takes one more step for the last rows.

    python bench/gpu_decode.py [--shapes llama-1b llama-8b] [--quantization none fp8] [--prefill]
                               [--out FILE]

--quantization fp8: every linear in float8 (per-channel scales), embeddings, norms and lm_head
bf16 (fp8_dynamic: their inputs rounded to float8 per token too, FP8 tensor cores); the roofline counts those bytes. Several formats: each shape in each (a shape whose weights
do not fit the GPU is skipped), fp8_over_bf16_tok_s_* their ratio. Each row reports kv_tokens, the cache's room. --prefill:
also prefill throughput, PREFILL_BATCH prompts of PREFILL_LEN tokens (one output token each).

Default --out: bench/results/h200_decode_<shapes>.json (h200_decode_1b.json, h200_decode_8b.json,
h200_decode_1b_8b.json). bench/results/h200.json (the goals' summary) is assembled by hand from
the standing decode and stream runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams  # noqa: E402
from hsserve.models.spec import ModelSpec  # noqa: E402

PROMPT, NEW = 128, 128
PREFILL_LEN, PREFILL_BATCH = 2048, 16


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * a.numel() * 2 * 10 / (start.elapsed_time(end) / 1000)


def engine_run(engine: Engine, batch: int, mode=HiddenStatesMode.NONE, tag: str = "",
               logprobs: int | None = None) -> dict:
    # NOTE: prompts differ per run (tag): a repeat must not find its prompts in the prefix cache
    g = torch.Generator().manual_seed(batch * 1000 + zlib.crc32(tag.encode()) % 1000)
    prompts = torch.randint(10, engine.spec.vocab_size - 10, (batch, PROMPT), generator=g).tolist()
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    first: list[float] = []
    last: list[float] = []
    reached: dict[int, float] = {}  # NOTE: output tokens -> when the last sequence had that many
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def sink(delta):
        now = time.perf_counter()
        with lock:
            if delta.token_ids and delta.num_output_tokens == len(delta.token_ids):
                first.append(now)
            if delta.token_ids:
                reached[delta.num_output_tokens] = now
            if delta.request_done:
                last.append(now)
                done.release()

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(f"{tag}{batch}-{i}", prompt_ids=p, sampling=sp,
                                        hidden_mode=mode,
                                        hidden_layers=(-1,) if mode else None), sink=sink)
    for _ in prompts:
        done.acquire()
    t_end = max(last)
    a, b = NEW // 8, NEW - NEW // 8  # NOTE: steady: the middle of the run, no start or end
    return {"step_ms": 1000 * (t_end - max(first)) / (NEW - 1), "tok_s": batch * NEW / (t_end - t0),
            "steady_step_ms": 1000 * (reached[b] - reached[a]) / (b - a)}


def graph_replay_ms(engine: Engine, batch: int, with_rows: bool = False) -> float:
    """GPU time of the decode graph alone (buffers as the last step left them), by events;
    with_rows: the variant that also copies the captured layers' rows."""
    graphs = engine.executor.graphs
    size = next(s for s in graphs.sizes if s >= batch)
    return event_ms(graphs.graphs[(size, with_rows)].replay, 50)


def make_engine(folder: str, batch: int, ceiling=HiddenStatesMode.FULL,
                async_scheduling: str = "auto", tp: int = 1, quantization: str = "none",
                max_model_len: int = PROMPT + NEW + 16, **extra) -> Engine:
    return Engine(EngineConfig(model=folder, device="cuda", load_format="dummy", dtype="bfloat16",
                               async_scheduling=async_scheduling, tensor_parallel_size=tp,
                               quantization=quantization,
                               max_num_seqs=max(batch, 1), max_model_len=max_model_len,
                               hidden_states_ceiling=ceiling,
                               hidden_layers_captured=(-1,) if ceiling else None,
                               max_num_batched_tokens=max(2048, batch * PROMPT), **extra)).start()


def best_of(engine: Engine, batch: int, repeats: int, modes=(HiddenStatesMode.NONE,)) -> dict:
    """mode -> the fastest of `repeats` runs; the modes' runs interleaved (a drift of the
    machine over the runs falls on each mode alike), each run with prompts of its own."""
    runs: dict = {m: [] for m in modes}
    for r in range(repeats):
        for m in modes:
            runs[m].append(engine_run(engine, batch, mode=m, tag=f"r{r}{m.name}-"))
    return {m: min(rs, key=lambda x: x["step_ms"]) for m, rs in runs.items()}


def logprobs_ab(engine: Engine, batch: int, repeats: int, k: int) -> dict:
    """Step time with every request asking for logprobs (k alternatives) against none, runs
    interleaved; the best of each."""
    plain, asked = [], []
    for r in range(repeats):
        plain.append(engine_run(engine, batch, tag=f"lp{r}n-")["step_ms"])
        asked.append(engine_run(engine, batch, tag=f"lp{r}y-", logprobs=k)["step_ms"])
    return {"logprobs_k": k, "logprobs_step_ms": round(min(asked), 3),
            "logprobs_none_step_ms": round(min(plain), 3),
            "logprobs_overhead": round(min(asked) / min(plain) - 1, 4)}


def prefill_tok_s(folder: str, quantization: str, repeats: int) -> float:
    """Prompt tokens a second: PREFILL_BATCH prompts of PREFILL_LEN tokens, one output token
    each, submitted at once (the best of `repeats` rounds, each with prompts of its own)."""
    engine = make_engine(folder, PREFILL_BATCH, ceiling=HiddenStatesMode.NONE,
                         quantization=quantization, max_model_len=PREFILL_LEN + 16)
    try:
        best = 0.0
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for r in range(repeats + 1):  # NOTE: round 0 warms up (Triton's autotune, allocator)
            g = torch.Generator().manual_seed(77 + r)
            prompts = torch.randint(10, engine.spec.vocab_size - 10, (PREFILL_BATCH, PREFILL_LEN),
                                    generator=g).tolist()
            t0 = time.perf_counter()
            streams = [engine.submit(GenerationRequest(f"p{r}-{i}", prompt_ids=p, sampling=sp))
                       for i, p in enumerate(prompts)]
            for st in streams:
                st.result(timeout=600)
            if r:
                best = max(best, PREFILL_BATCH * PREFILL_LEN / (time.perf_counter() - t0))
        return best
    finally:
        engine.shutdown()


def weight_bytes(spec, batch: int = 1, linear_bytes: int = 2) -> int:
    """Bytes of weights a decode step reads: a mixture-of-experts layer's router and the experts
    its `batch` tokens are expected to pick (uniform routing: random weights); linear_bytes: a
    linear's element (1: float8; embeddings, norms and lm_head stay bf16)."""
    h, i, L, v = spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    mlp = 3 * h * i
    if spec.num_experts:
        e, k, mi = spec.num_experts, spec.experts_per_token, spec.moe_intermediate_size
        mlp = e * h + e * (1 - (1 - k / e) ** batch) * 3 * h * mi
    linears = h * (q + 2 * kv) + q * h + mlp
    # NOTE: the lm_head (tied or not) is read in full; float8 weights' scales: 4 bytes a row
    scales = (q + 2 * kv + h + 2 * i + h) * 4 if linear_bytes == 1 else 0
    return int(L * (linear_bytes * linears + 2 * 2 * h + scales) + 2 * (v * h + h))


def kv_bytes(spec, batch: int, ctx: int) -> int:
    return 2 * batch * ctx * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim


def hf_steps(folder: str, batch: int) -> dict:
    """transformers generate: ms per decode step, eager (dynamic cache) and static cache."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(10, cfg.vocab_size - 10, (batch, PROMPT), device="cuda")
    out = {}
    for name, kw in (("eager", {}), ("static", {"cache_implementation": "static"})):
        def gen(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
            torch.cuda.synchronize()
            return time.perf_counter() - t
        gen(4)
        one, full = min(gen(1) for _ in range(2)), min(gen(NEW) for _ in range(2))
        out[f"hf_{name}_step_ms"] = round(1000 * (full - one) / (NEW - 1), 3)
        out[f"hf_{name}_tok_s"] = round(batch * NEW / full, 1)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def batch_row(args, folder: str, shape: str, batch: int, quant: str, bw: float, keys: dict) -> dict:
    """One engine at one batch size: its best decode run against the roofline (batch 64 of the
    1B shape: MODE=last, logprobs and the none ceiling beside it), prefill at batch 1."""
    short = shape.split("-")[1]
    tp = args.tensor_parallel
    engine = make_engine(folder, batch, async_scheduling=args.async_scheduling, tp=tp,
                         quantization=quant)
    try:
        modes = [HiddenStatesMode.NONE]
        if batch == 64 and short == "1b":
            modes.append(HiddenStatesMode.LAST)
        best = best_of(engine, batch, args.repeats, modes)
        r = best[HiddenStatesMode.NONE]
        lb = 1 if quant.startswith("fp8") else 2
        # NOTE: spec is rank 0's shard under tensor parallelism: the whole model's bytes over
        # N GPUs' bandwidth
        whole = ModelSpec.from_folder(folder) if tp > 1 else engine.spec
        roof = 1000 * (weight_bytes(whole, batch, lb) + kv_bytes(whole, batch, PROMPT + NEW // 2)
                       ) / (bw * tp)
        row = {"shape": shape, "batch": batch, "tensor_parallel": tp, "quantization": quant,
               "kv_tokens": engine.pool.num_blocks * engine.pool.block_size,
               "step_ms": round(r["step_ms"], 3), "tok_s": round(r["tok_s"], 1),
               "graph_replay_ms": round(graph_replay_ms(engine, batch), 3),
               "roofline_ms": round(roof, 3), "step_over_roofline": round(r["step_ms"] / roof, 2),
               "graph_captures": engine.num_graph_captures}
        if HiddenStatesMode.LAST in best:
            last = best[HiddenStatesMode.LAST]
            row["last_step_ms"] = round(last["step_ms"], 3)
            row["steady_step_ms"] = round(r["steady_step_ms"], 3)
            row["last_steady_step_ms"] = round(last["steady_step_ms"], 3)
            row["graph_with_rows_replay_ms"] = round(graph_replay_ms(engine, batch, True), 3)
            keys["last_vs_none_overhead_bs64"] = round(last["step_ms"] / r["step_ms"] - 1, 4)
        if args.logprobs is not None and batch == 64 and short == "1b":
            row.update(logprobs_ab(engine, batch, args.repeats, args.logprobs))
            keys["logprobs_vs_none_overhead_bs64"] = row["logprobs_overhead"]
    finally:
        engine.shutdown()
    if batch == 64 and short == "1b":
        plain = make_engine(folder, batch, ceiling=HiddenStatesMode.NONE,
                            async_scheduling=args.async_scheduling, quantization=quant)
        try:
            p = best_of(plain, batch, args.repeats)[HiddenStatesMode.NONE]
        finally:
            plain.shutdown()
        row["none_ceiling_step_ms"] = round(p["step_ms"], 3)
        keys["none_under_full_ceiling_overhead"] = round(r["step_ms"] / p["step_ms"] - 1, 4)
    if not args.no_hf:
        row.update(hf_steps(folder, batch))
    if args.prefill and batch == 1:
        row["prefill_tok_s"] = round(prefill_tok_s(folder, quant, args.repeats), 1)
    return row


def fits(folder: str, quant: str, tp: int) -> bool:
    """Whether the shape's weights take at most 95% of the GPU's memory (bf16 70B on one GPU
    does not)."""
    lb = 1 if quant.startswith("fp8") else 2
    return weight_bytes(ModelSpec.from_folder(folder), 1, lb) / tp < 0.95 * torch.cuda.mem_get_info()[1]


def shape_rows(args, shape: str, quant: str, bw: float, keys: dict) -> list[dict]:
    """The rows of one shape in one weight format, a fresh engine per batch size; `keys` gets
    the summary figures."""
    folder = random_model(shape)
    short = shape.split("-")[1]
    if not fits(folder, quant, args.tensor_parallel):
        print(f"{shape} {quant}: the weights do not fit this GPU; skipped", flush=True)
        keys.setdefault("skipped", []).append(f"{shape} {quant}")
        return []
    rows = []
    tag = "" if quant == "none" else f"_{quant}"
    for batch in (args.batches_1b if short == "1b" else args.batches_8b):
        row = batch_row(args, folder, shape, batch, quant, bw, keys)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if short == "1b" and batch == 1:
            keys[f"decode_step_ms_bs1_1b{tag}"] = row["step_ms"]
        if short == "1b" and batch == 64:
            keys[f"decode_tok_s_bs64_1b{tag}"] = round(64 * 1000 / row["step_ms"], 1)
        if short != "1b":
            keys[f"decode_step_ms_bs{batch}_{short}{tag}"] = row["step_ms"]
            keys[f"step_over_roofline_bs{batch}_{short}{tag}"] = row["step_over_roofline"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"], choices=sorted(SHAPES))
    ap.add_argument("--batches-1b", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--batches-8b", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--no-pdl", action="store_true", help="kernels without dependent launch (A/B)")
    ap.add_argument("--splits", type=int, help="decode attention splits at most (A/B)")
    ap.add_argument("--logprobs", type=int, help="batch 64 (1B): also every request asking for "
                    "logprobs with this many alternatives, against none")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (GPUs) per engine; the "
                    "roofline then reads the weights at that many times the copy bandwidth")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    choices=["none", "fp8", "fp8_dynamic"],
                    help="weight formats, each shape run in each (fp8 beside none: their ratio)")
    ap.add_argument("--prefill", action="store_true", help="also prefill tok/s per shape")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not args.out:
        tags = "_".join(s.split("-")[1] for s in args.shapes)
        args.out = os.path.join(os.path.dirname(__file__), "results", f"h200_decode_{tags}.json")
    if args.no_pdl:
        import hsserve.kernels.pdl as pdl

        pdl._supported = lambda _index: False  # NOTE: every launch asks pdl_on
    if args.splits:
        import hsserve.kernels.paged_decode_attention as pda

        choose = pda.choose_num_splits
        pda.choose_num_splits = lambda *a, **kw: min(args.splits, choose(*a, **kw))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows, keys = [], {}
    for shape in args.shapes:
        for quant in args.quantization:
            rows += shape_rows(args, shape, quant, bw, keys)
    by = {(r["shape"], r["batch"], r["quantization"]): r["tok_s"] for r in rows}
    for (shape, batch, quant), tok_s in by.items():
        if quant != "none" and (shape, batch, "none") in by:
            keys[f"{quant}_over_bf16_tok_s_bs{batch}_{shape.split('-')[1]}"] = round(
                tok_s / by[shape, batch, "none"], 3)
    write_result(args.out, {"benchmark": "gpu_decode", "copy_bandwidth_tb_s": round(bw / 1e12, 3),
                            "prompt_len": PROMPT, "new_tokens": NEW, "dtype": "bfloat16",
                            "quantizations": args.quantization,
                            "async_scheduling": args.async_scheduling, "pdl": not args.no_pdl,
                            "max_splits": args.splits,
                            **keys, "rows": rows})


if __name__ == "__main__":
    main()
