"""Where the batch-1 decode graph's time goes, by taking parts out (1B shape, random bf16, H200).

Each variant patches one part of the decoder, starts a fresh engine (its graphs captured with the
patch), decodes one request to warm it, then times the batch-1 graph's replay. The differences to
`full` are what each part costs in place, inside the PDL chain (a kernel profile cannot say: the
kernels overlap). The outputs are wrong in every variant but `full`: this is timing only.

    python bench/gpu_ablation.py [--variants full no_attention ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from unittest import mock

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402
from gpu_decode import engine_run, graph_replay_ms, make_engine  # noqa: E402
from shapes import random_model  # noqa: E402

from hsserve import HiddenStatesMode  # noqa: E402
from hsserve.kernels.pdl import pdl_enter, pdl_on  # noqa: E402
from hsserve.kernels import gemv as gemv_module  # noqa: E402
from hsserve.kernels import paged_decode_attention as pda  # noqa: E402
from hsserve.models import decoder  # noqa: E402
from hsserve.engine import cuda_graphs  # noqa: E402
from hsserve.kernels.elementwise import embed_rotary_ref  # noqa: E402

_ATTEND = decoder.attend
_GEMV_CONFIG = gemv_module.gemv_config


@triton.jit
def _copy_kernel(X, Y, N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.arange(0, N)
    tl.store(Y + r, tl.load(X + r))


def _decode_only(fn):
    """fn in attention's place for decode steps; prefill keeps the real attention."""
    def attend(q, kv, batch, scale, window):
        if batch.kernels and batch.all_decode:
            return fn(q, kv, batch, scale, window)
        return _ATTEND(q, kv, batch, scale, window)
    return attend


@_decode_only
def _copy_attention(q, kv, batch, scale, window):
    """A one-program PDL kernel in attention's place: the cost of a kernel boundary alone."""
    out = torch.empty_like(q)
    pdl = pdl_on(q)
    _copy_kernel[(1,)](q, out, N=q.numel(), PDL=pdl, launch_pdl=pdl)
    return out


@triton.jit
def _copy_grid_kernel(X, Y, PER: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    r = pid * PER + tl.arange(0, PER)
    tl.store(Y + r, tl.load(X + r))


@_decode_only
def _copy_attention_grid(q, kv, batch, scale, window):
    """The same copy spread over the decode attention's grid (KV heads x splits programs): the
    cost of its program count without its work."""
    from hsserve.kernels.paged_decode_attention import choose_num_splits

    out = torch.empty_like(q)
    splits = choose_num_splits(len(q), kv.shape[-2], batch.decode_block_tables.shape[1])
    grid = (kv.shape[-2], splits)
    pdl = pdl_on(q)
    _copy_grid_kernel[grid](q, out, PER=q.numel() // (grid[0] * grid[1]), PDL=pdl,
                            launch_pdl=pdl)
    return out


def _splits(n: int):
    choose = pda.choose_num_splits
    return [(pda, "choose_num_splits", lambda *a, **kw: min(n, choose(*a, **kw)))]


def _no_mlp(self, x, folded_eps=None):
    return x


def _warps(n: int):
    """gemv_config with its program count kept and num_warps forced to n."""
    def config(*a):
        return _GEMV_CONFIG(*a)[0], n
    return config


def _slabs(qkv: int, o: int, gate_up: int, down: int, warps: int | None = None):
    """gemv_config with W bytes per program (KB) chosen per product of the 1B shape (known by
    its (n, k, itemsize) arguments); warps forced where given."""
    kb = {(32, 2048, 4): qkv, (2048, 2048, 2): o, (8192, 2048, 4): gate_up, (2048, 8192, 2): down}

    def config(n, k, itemsize):
        with mock.patch.object(gemv_module, "_SLAB_BYTES", kb.get((n, k, itemsize), 16) << 10):
            block_n, w = _GEMV_CONFIG(n, k, itemsize)
        return block_n, warps or w
    return config


def _attention_config(tokens: int, warps: int, stages: int):
    """The batch-1 (PDL) decode attention's launch configuration (heads of 64)."""
    return [(pda, "_PDL_CONFIG", {64: (tokens, warps, stages)})]


@_decode_only
def _no_attention(q, kv, batch, scale, window):
    return q


_GRAPH_FORWARD = cuda_graphs.DecodeGraphs._forward


def _no_argmax(self, size, with_rows):
    """DecodeGraphs._forward without the argmax at its end."""
    with mock.patch.object(cuda_graphs, "argmax_rows", lambda x, out, host: out):
        return _GRAPH_FORWARD(self, size, with_rows)


def _head(norm: bool, lm_head: bool):
    """Decoder.decode_logits as the layers, then the final norm and the lm_head where asked, as
    separate kernels (cuBLAS's lm_head): both = the path before the norm went into the GEMV."""
    def decode_logits(self, input_ids, positions, batch, kv_cache, capture, out):
        x, residual = self._layers(input_ids, positions, batch, kv_cache, capture)
        if norm:
            x = self._final(x, residual, capture)
        if lm_head:
            self.logits(x, out=out)
    return decode_logits


D, G, M = decoder, gemv_module, decoder.MLP
# NOTE: name -> [(object, attribute, replacement)]
VARIANTS = {
    "full": [],
    "no_attention": [(D, "attend", _no_attention)],
    "copy_attention": [(D, "attend", _copy_attention)],
    "no_mlp": [(M, "forward", _no_mlp)],
    "no_argmax": [(cuda_graphs.DecodeGraphs, "_forward", _no_argmax)],
    "no_head": [(D.Decoder, "decode_logits", _head(False, False))],
    "norm_cublas_lm_head": [(D.Decoder, "decode_logits", _head(True, True))],
    # NOTE: the embedding and rotary angles as torch ops (five kernels) instead of embed_rotary
    "torch_prologue": [(D, "embed_rotary", embed_rotary_ref)],
    "no_lm_head": [(D.Decoder, "decode_logits", _head(True, False))],
    "slab16k": [(G, "_SLAB_BYTES", 16 << 10)],
    "splits4": _splits(4),
    "slab8k": [(G, "_SLAB_BYTES", 8 << 10)],
    "slab32k": [(G, "_SLAB_BYTES", 32 << 10)],
    "slab64k": [(G, "_SLAB_BYTES", 64 << 10)],
    "slab32k_w8": [(G, "_SLAB_BYTES", 32 << 10), (G, "gemv_config", _warps(8))],
    "mlp32k": [(G, "gemv_config", _slabs(16, 16, 32, 32))],
    "gate_up32k": [(G, "gemv_config", _slabs(16, 16, 32, 16))],
    "down32k": [(G, "gemv_config", _slabs(16, 16, 16, 32))],
    "attn32k": [(G, "gemv_config", _slabs(32, 32, 16, 16))],
    "gate_up64k": [(G, "gemv_config", _slabs(32, 32, 64, 32))],
    "down64k": [(G, "gemv_config", _slabs(32, 32, 32, 64))],
    "qkv64k": [(G, "gemv_config", _slabs(64, 32, 32, 32))],
    "o8k": [(G, "gemv_config", _slabs(32, 8, 32, 32))],
    "copy_attention_grid": [(D, "attend", _copy_attention_grid)],
    "s32_copy_attention": [(G, "_SLAB_BYTES", 32 << 10), (D, "attend", _copy_attention)],
    "s32_copy_attention_grid": [(G, "_SLAB_BYTES", 32 << 10),
                                (D, "attend", _copy_attention_grid)],
    "s32_splits8": [(G, "_SLAB_BYTES", 32 << 10)] + _splits(8),
    "s32_splits4": [(G, "_SLAB_BYTES", 32 << 10)] + _splits(4),
    "s32_splits2": [(G, "_SLAB_BYTES", 32 << 10)] + _splits(2),
    "attn_64_4_1": _attention_config(64, 4, 1),
    "attn_32_4_1": _attention_config(32, 4, 1),
    "attn_64_4_2": _attention_config(64, 4, 2),
    "attn_64_4_1_splits4": _attention_config(64, 4, 1) + _splits(4),
    "attn_32_4_1_splits8": _attention_config(32, 4, 1) + _splits(8),
    # NOTE: one split's tile holds a short context whole (read before the PDL wait, no merge)
    "attn_128_8_1": _attention_config(128, 8, 1),
    "attn_256_8_1": _attention_config(256, 8, 1),
    "attn_256_16_1": _attention_config(256, 16, 1),
    # NOTE: fewer registers a program (ptxas, sm_90: 64/4 warps 255 with spills, 32/4 149,
    # 16/4 96, 16/2 147 x 64 threads, 16/1 178 x 32), so that attention and o_proj programs
    # are resident beside the qkv / attention programs before their wait
    "attn_32_4_2": _attention_config(32, 4, 2),
    "attn_64_8_1": _attention_config(64, 8, 1),  # NOTE: 141 registers, no spills
    "attn_128_16_1": _attention_config(128, 16, 1),  # NOTE: 128 registers, no spills
    "attn_16_4_1": _attention_config(16, 4, 1),
    "attn_16_2_1": _attention_config(16, 2, 1),
    "attn_16_1_1": _attention_config(16, 1, 1),
    "attn_16_1_1_splits4": _attention_config(16, 1, 1) + _splits(4),
    "attn_16_4_1_splits4": _attention_config(16, 4, 1) + _splits(4),
    "attn_32_4_1_splits4": _attention_config(32, 4, 1) + _splits(4),
    # NOTE: the weights without their L2 hint (evict_first)
    "w_no_hint": [(G, "_W_POLICY", "")],
    "warps2": [(G, "gemv_config", _warps(2))],
    "warps8": [(G, "gemv_config", _warps(8))],
}


def patched(stack: ExitStack, patches) -> None:
    for obj, name, value in patches:
        stack.enter_context(mock.patch.object(obj, name, value))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "h200_ablation.json"))
    args = ap.parse_args()
    folder = random_model("llama-1b")
    rows = {}
    for name in args.variants:
        with ExitStack() as stack:
            patched(stack, VARIANTS[name])
            engine = make_engine(folder, 1, ceiling=HiddenStatesMode.NONE)
            engine.executor.graphs.logits.zero_()  # NOTE: finite logits where nothing writes them
            try:
                engine_run(engine, 1, tag=name)
                rows[name] = min(graph_replay_ms(engine, 1) for _ in range(args.repeats))
            finally:
                engine.shutdown()
        print(f"{name:28s} graph {rows[name]:.4f} ms  vs full "
              f"{1000 * (rows[name] - rows.get('full', rows[name])):+.1f} us", flush=True)
        torch.cuda.empty_cache()
    write_result(args.out, {"benchmark": "gpu_ablation (llama-1b, batch 1, graph replay ms)",
                            "graph_replay_ms": rows})


if __name__ == "__main__":
    main()
