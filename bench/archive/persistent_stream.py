"""How fast one persistent kernel can stream a decode step's weights through grid barriers (H200).

A batch-1 decode step reads every weight once in a chain of dependent products (per layer qkv,
o, gate_up, down; then the lm_head). Our step chains one kernel per product with programmatic
dependent launch; a "megakernel" instead keeps one program per SM alive for the whole step and
synchronizes the grid between products. This skeleton measures the second design's ceiling
without its arithmetic: the 1B shape's bytes in its 65 phases, each program summing its share
of a phase (bfloat16 tiles of _UNROLL chunks of CHUNK elements, two tiles in flight), and
between phases

  - none:      no synchronization (this kernel's own streaming rate)
  - barrier:   a grid barrier (an atomic counter every program adds to with release semantics,
               as a real kernel's outputs need, then spins on); _relaxed: a relaxed add
  - prefetch:  the same barrier, with each program's first tile of the next phase loaded
               before it arrives and added after (bytes in flight while the grid waits, unless
               the release makes the arrival wait for them)

A grid that cannot be resident all at once (a barrier would wait for programs that never start)
is skipped. H200 results and what they say: bench/README.md.

Times are per step (one launch: all phases), events around 20 launches after warm-up; the
copy-bandwidth floor as gpu_decode.py measures it. Timing only: the sums are discarded.

    python bench/persistent_stream.py [--programs 132 264] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from gpu_decode import copy_bandwidth  # noqa: E402

# NOTE: Llama-3.2-1B, bfloat16 elements per product: qkv, o, gate_up, down per layer; lm_head
_LAYER = (2048 * 3072, 2048 * 2048, 2048 * 16384, 8192 * 2048)
_LM_HEAD = 2048 * 128256
_UNROLL = 8  # NOTE: chunks per tile (8 x 4 KB); a program has two tiles in flight


def phases(chunk: int) -> list[int]:
    """Elements per phase, each rounded down to whole chunks."""
    sizes = [n for _ in range(16) for n in _LAYER] + [_LM_HEAD]
    return [n // chunk * chunk for n in sizes]


@triton.jit
def _arrive_and_wait(COUNTER, target, RELEASE: tl.constexpr):
    tl.debug_barrier()  # NOTE: the whole program is done with the phase before it arrives
    if RELEASE:  # NOTE: what a real kernel needs (its outputs ordered before the arrival)
        tl.atomic_add(COUNTER, 1, sem="release")
    else:
        tl.atomic_add(COUNTER, 1, sem="relaxed")
    spins = 0  # NOTE: bounded, so that a grid that is not all resident ends instead of hanging
    while (tl.atomic_add(COUNTER, 0, sem="acquire") < target) & (spins < 200000):
        spins += 1


@triton.jit
def _chunks(W, start, count, c0, step, N: tl.constexpr, r, CHUNK: tl.constexpr):
    """Chunks c0, c0 + step, ... (N of them) of the phase at `start` (count chunks; zeros past
    its end), as one [N, CHUNK] load: all of it in flight at once."""
    c = c0 + tl.arange(0, N) * step
    return tl.load(W + start + c[:, None] * CHUNK + r[None, :], mask=(c < count)[:, None],
                   other=0.0)


@triton.jit
def _stream_kernel(W, STARTS, COUNTER, OUT, NUM_PHASES: tl.constexpr, CHUNK: tl.constexpr,
                   UNROLL: tl.constexpr, SYNC: tl.constexpr, RELEASE: tl.constexpr,
                   PREFETCH: tl.constexpr):
    # NOTE: a program reads tiles of UNROLL chunks (pid, pid + P, ...), double-buffered: tile t + 1
    # is loaded before tile t is summed; with PREFETCH the next phase's first tile is loaded
    # before the barrier, else after it
    pid = tl.program_id(0)
    p_count = tl.num_programs(0)
    step = p_count * UNROLL
    r = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    start = tl.load(STARTS)
    chunks = (tl.load(STARTS + 1) - start) // CHUNK
    cur = _chunks(W, start, chunks, pid, p_count, UNROLL, r, CHUNK)
    for ph in range(NUM_PHASES):
        tiles = tl.maximum(tl.cdiv(chunks - pid, step), 1)
        for t in range(1, tiles):
            nxt = _chunks(W, start, chunks, pid + t * step, p_count, UNROLL, r, CHUNK)
            acc += tl.sum(cur.to(tl.float32), 0)
            cur = nxt
        start = tl.load(STARTS + ph + 1)
        chunks = (tl.load(STARTS + ph + 2) - start) // CHUNK
        if PREFETCH:
            nxt = _chunks(W, start, chunks, pid, p_count, UNROLL, r, CHUNK)
            acc += tl.sum(cur.to(tl.float32), 0)
            if SYNC:
                _arrive_and_wait(COUNTER, (ph + 1) * p_count, RELEASE)
            cur = nxt
        else:
            acc += tl.sum(cur.to(tl.float32), 0)
            if SYNC:
                _arrive_and_wait(COUNTER, (ph + 1) * p_count, RELEASE)
            cur = _chunks(W, start, chunks, pid, p_count, UNROLL, r, CHUNK)
    tl.store(OUT + pid * CHUNK + r, acc)


def step_ms(w, starts, counter, out, programs, chunk, sync, release, prefetch,
            warps) -> float | None:
    """ms per launch; None where the grid cannot be resident all at once (a barrier would wait
    for programs that never start)."""
    meta = dict(NUM_PHASES=len(starts) - 2, CHUNK=chunk, UNROLL=_UNROLL, SYNC=sync,
                RELEASE=release, PREFETCH=prefetch, num_warps=warps)

    def launch():
        counter.zero_()
        _stream_kernel[(programs,)](w, starts, counter, out, **meta)
    kernel = _stream_kernel.warmup(w, starts, counter, out, grid=(programs,), **meta)
    kernel._init_handles()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = -(-programs // sms)
    if sync and kernel.n_regs * warps * 32 * per_sm > 65536:
        return None
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        launch()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", type=int, nargs="+", default=[132, 264])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "h200_persistent_stream.json"))
    args = ap.parse_args()
    sizes = phases(args.chunk)
    total = sum(sizes)
    w = torch.empty(total, dtype=torch.bfloat16, device="cuda").normal_()
    # NOTE: phase i spans starts[i]..starts[i + 1]; one more entry (an empty phase) past the end
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()
    starts = torch.tensor([0] + ends + [total], dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    bw = copy_bandwidth()
    floor = total * 2 / bw * 1000
    rows = {}
    print(f"{total * 2 / 1e9:.3f} GB in {len(sizes)} phases; floor {floor:.4f} ms at "
          f"{bw / 1e12:.2f} TB/s")
    for programs in args.programs:
        out = torch.empty(programs * args.chunk, dtype=torch.float32, device="cuda")
        for name, sync, release, prefetch in (
                ("none", False, False, True), ("barrier", True, True, False),
                ("barrier_relaxed", True, False, False), ("prefetch", True, True, True),
                ("prefetch_relaxed", True, False, True)):
            for warps in (8,):
                key = f"{name} p{programs} w{warps}"
                ms = step_ms(w, starts, counter, out, programs, args.chunk, sync, release,
                             prefetch, warps)
                if ms is None:
                    print(f"{key:28s} skipped: not all resident", flush=True)
                    continue
                rows[key] = ms
                print(f"{key:28s} {ms:.4f} ms  ({ms / floor:.2f}x floor)", flush=True)
    write_result(args.out, {"benchmark": "persistent_stream (llama-1b bytes, one launch a step)",
                            "bytes": total * 2, "copy_bandwidth_tb_s": bw / 1e12,
                            "floor_ms": floor, "chunk": args.chunk, "step_ms": rows})


if __name__ == "__main__":
    main()
