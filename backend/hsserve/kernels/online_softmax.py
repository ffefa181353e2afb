"""The online-softmax step both paged attention kernels take per tile of keys (@triton.jit helper).

One step folds a tile of keys into a running (max m, sum l, weighted values acc) per query row:
scores = q k^T * scale (soft-capped for Gemma 2) where visible, else -inf; then the usual rescale. A row that has seen only
masked keys keeps m = -inf, so exp(-inf - -inf) is guarded.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(q, k, v, visible, m, l, acc, scale, IEEE: tl.constexpr, softcap=0.0,
                        SOFTCAP: tl.constexpr = False):
    """q [R, D], k/v [N, D], visible [R, N] -> the updated (m [R], l [R], acc [R, D]). SOFTCAP
    (Gemma 2): scores capped to softcap * tanh(scores / softcap) before the mask."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if SOFTCAP:  # NOTE: tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l, acc * alpha[:, None] + pv
