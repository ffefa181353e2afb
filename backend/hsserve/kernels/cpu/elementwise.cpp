// The decode path's elementwise kernels: rotary + the cache writes, add + RMSNorm, SiLU-and-mul.
#include "common.h"

using hs::dot;
using hs::fast_exp;

extern "C" {

// qkv [T, H + 2 KVH, D] contiguous: q and k heads rotated in place (rotate-half; cos / sin
// [T, D]), then k and v written to one layer's cache [2, slots, KVH, D] at slots[t] (< 0: skip).
void hs_rotary_store(float* qkv, int T, int H, int KVH, int D, const float* cos, const float* sin,
                     float* kv, int64_t half_elems, const int64_t* slots, int threads) {
  const int half = D / 2, heads = H + 2 * KVH;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < T; ++t) {
    float* row = qkv + (int64_t)t * heads * D;
    const float* c = cos + (int64_t)t * D;
    const float* s = sin + (int64_t)t * D;
    for (int h = 0; h < H + KVH; ++h) {
      float* x = row + h * D;
      for (int i = 0; i < half; ++i) {
        const float a = x[i], b = x[i + half];
        x[i] = a * c[i] + (-b) * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
    if (slots[t] < 0) continue;
    float* kd = kv + slots[t] * KVH * D;
    float* vd = kd + half_elems;
    std::copy(row + H * D, row + (H + KVH) * D, kd);
    std::copy(row + (H + KVH) * D, row + heads * D, vd);
  }
}

// x [T, N] (+ residual) -> out = w * (s / sqrt(mean(s^2) + eps)), s = x + residual (written to
// sum when there is a residual): the add and the norm in one pass over each row.
void hs_add_rmsnorm(const float* x, const float* residual, const float* w, float* out, float* sum,
                    int T, int N, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
  for (int t = 0; t < T; ++t) {
    const float* xr = x + (int64_t)t * N;
    const float* s = xr;
    if (residual != nullptr) {
      float* sr = sum + (int64_t)t * N;
      const float* rr = residual + (int64_t)t * N;
      for (int i = 0; i < N; ++i) sr[i] = xr[i] + rr[i];
      s = sr;
    }
    const float inv = 1.f / std::sqrt(dot(s, s, N) / N + eps);
    float* o = out + (int64_t)t * N;
    for (int i = 0; i < N; ++i) o[i] = w[i] * (s[i] * inv);
  }
}

// gate_up [T, 2N] -> out [T, N] = silu(gate) * up
void hs_silu_mul(const float* gate_up, float* out, int T, int N, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int t = 0; t < T; ++t) {
    const float* g = gate_up + (int64_t)t * 2 * N;
    const float* u = g + N;
    float* o = out + (int64_t)t * N;
    for (int i = 0; i < N; ++i) o[i] = g[i] / (1.f + fast_exp(-g[i])) * u[i];
  }
}

// out [R, V] = logits where bit v of row r's bitmask [R, W] is set, else -inf (guided decoding)
void hs_mask_logits(const float* logits, const int32_t* bitmask, float* out, int R, int V, int W,
                    int threads) {
  const float neg = -__builtin_inff();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < R; ++r) {
    const float* l = logits + (int64_t)r * V;
    const uint32_t* b = (const uint32_t*)(bitmask + (int64_t)r * W);
    float* o = out + (int64_t)r * V;
    for (int v = 0; v < V; ++v) o[v] = (b[v >> 5] >> (v & 31)) & 1u ? l[v] : neg;
  }
}

}  // extern "C"
