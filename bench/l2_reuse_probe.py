"""Does a weight asked of L2 (kernels/l2_prefetch.py) stay there past a larger stream of normal
loads, so a GEMV after finds it? One H200 graph per variant, us a replay (best of 3 x 200):
gemv alone; gemv twice (the second from L2?); prefetch then gemv; prefetch, a 75 MB stream, gemv
(each prefetch MODE). Qwen3-30B-A3B's qkv shape (5120 x 2048 bf16, 21 MB)."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms  # noqa: E402
from hsserve.kernels.gemv import gemv  # noqa: E402
from hsserve.kernels.l2_prefetch import nbytes, prefetch_l2  # noqa: E402


@triton.jit
def _ask(W, n, MODE: tl.constexpr):
    prefetch_l2(W, 0, n, tl.program_id(0), tl.num_programs(0), 64, MODE)


def main() -> None:
    dev = torch.device("cuda")
    w = torch.randn(5120, 2048, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)
    big = torch.randn(75 << 20 >> 1, device=dev, dtype=torch.bfloat16)
    sink = torch.empty(1, device=dev)

    def stream():
        torch.sum(big, dim=0, out=sink[0])

    def ask(mode):
        _ask[(132,)](w, nbytes(w), MODE=mode, num_warps=2)

    variants = {"gemv": lambda: gemv(x, w, pdl=False), "stream": stream,
                "stream_gemv": lambda: (stream(), gemv(x, w, pdl=False)),
                "gemv_gemv": lambda: (gemv(x, w, pdl=False), gemv(x, w, pdl=False))}
    for mode in (1, 2, 3):
        variants[f"ask{mode}"] = lambda m=mode: ask(m)
        variants[f"ask{mode}_gemv"] = lambda m=mode: (ask(m), gemv(x, w, pdl=False))
        variants[f"ask{mode}_stream"] = lambda m=mode: (ask(m), stream())
        variants[f"ask{mode}_stream_gemv"] = lambda m=mode: (ask(m), stream(), gemv(x, w, pdl=False))
    out = {}
    for name, fn in variants.items():
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out[name] = round(1000 * min(event_ms(g.replay, 200) for _ in range(3)), 2)
        print(json.dumps({"variant": name, "us": out[name]}), flush=True)


if __name__ == "__main__":
    main()
