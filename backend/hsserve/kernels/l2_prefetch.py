"""Weights pulled into L2 while the memory system would idle (sm_90+, one-row decode).

At one token a mixture-of-experts layer waits on latency twice with nothing to read: while its
routing runs (the experts are not known yet) and before down can start. prefetch_l2 asks L2 for
bytes that a later kernel will read (bulk prefetches: no registers, nothing waits for them), so
that kernel finds them there: the router's programs ask for the next layer's qkv weights, and
gate_up's for its expert's down weights. Only under PDL (never under Triton's interpreter: it
has no inline PTX); the kernels take a PREFETCH constexpr.
"""

from __future__ import annotations


import triton
import triton.language as tl

CHUNKS = tl.constexpr(64)  # NOTE: bulk prefetches a program issues (one a thread at 2 warps)


@triton.jit
def prefetch_l2(base, first, nbytes, part, parts, CHUNKS: tl.constexpr, MODE: tl.constexpr):
    """Ask L2 for share `part` of `parts` of the nbytes from byte `first` of base (16-byte
    aligned), in CHUNKS chunks of a multiple of 16 bytes (the last clipped, or none). MODE: 1 bulk
    prefetches, 2 the same kept evict_last (past a stream of normal loads larger than L2), 3 a
    prefetch a 128-byte line, evict_last."""
    chunk = tl.cdiv(tl.cdiv(nbytes, parts), 16 * CHUNKS) * 16
    start = (part.to(tl.int64) * CHUNKS + tl.arange(0, CHUNKS)) * chunk
    size = tl.minimum(tl.maximum(nbytes - start, 0), chunk).to(tl.int32)
    ptrs = base.to(tl.pointer_type(tl.int8)) + first + start
    if MODE == 1:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0;\n"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; }\n mov.u32 $0, 0;",
            "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.gt.s32 p, $2, 0;\n"
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n"
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; }\n"
            "mov.u32 $0, 0;", "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for off in range(0, chunk, 128):
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0;\n"
                "@p prefetch.global.L2::evict_last [$1]; }\n mov.u32 $0, 0;",
                "=r,l,r", [ptrs + off, size - off], dtype=tl.int32, is_pure=False, pack=1)


def nbytes(t) -> int:
    """A contiguous tensor's bytes (what prefetch_l2 asks for)."""
    return t.numel() * t.element_size()

