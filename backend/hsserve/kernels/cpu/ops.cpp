// CPU kernels for the decoder's float32 decode path, called through ctypes (cpu_ops.py).
// Built with -ffp-contract=off: each product and sum rounds as torch's separate ops do.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int n) {
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + 16 <= n; d += 16)
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d)));
  float s = _mm512_reduce_add_ps(acc);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}
#elif defined(__AVX2__)
inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int d = 0;
  for (; d + 8 <= n; d += 8)
    acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float s = _mm_cvtss_f32(h);
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}
#else
inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}
#endif

// exp(x) within ~1 ulp for the loops here: branch-free (so the compiler vectorizes it, where
// libm's expf stays scalar); below -87.3 it gives the smallest normal float (no subnormals), a
// softmax's 0.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.33654f), 88.37626f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

constexpr int MAX_HEADS = 64, MAX_DIM = 256, CHUNK = 32, AHEAD = 6;

// The cache lines of key j's heads [kv0, kv1), fetched ahead: its block is anywhere in the cache,
// where the hardware's stream prefetcher cannot guess it.
inline void prefetch_row(const float* base, const int32_t* table, int j, int kv0, int kv1, int KVH,
                         int D, int BS, int64_t block_elems) {
  const char* p = reinterpret_cast<const char*>(
      base + table[j / BS] * block_elems + ((int64_t)(j % BS) * KVH + kv0) * D);
  const int bytes = (kv1 - kv0) * D * (int)sizeof(float);
  for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// One sequence, KV heads [kv0, kv1) with their query heads (G each): online softmax over the keys
// in chunks of CHUNK. A key's heads are adjacent in the cache, so each chunk's K (then V) rows
// are read as one stream.
void attend_seq(const float* q, const float* kc, const float* vc, const int32_t* table, int len,
                int kv0, int kv1, int G, int KVH, int D, int BS, int64_t block_elems, float scale,
                int window, float softcap, float* out) {
  const int h0 = kv0 * G, nh = (kv1 - kv0) * G;
  float m[MAX_HEADS], l[MAX_HEADS], acc[MAX_HEADS][MAX_DIM], s[MAX_HEADS][CHUNK];
  for (int h = 0; h < nh; ++h) {
    m[h] = -INFINITY; l[h] = 0.f;
    for (int d = 0; d < D; ++d) acc[h][d] = 0.f;
  }
  const int start = window > 0 ? std::max(0, len - window) : 0;
  for (int j0 = start; j0 < len; j0 += CHUNK) {
    const int n = std::min(CHUNK, len - j0);
    for (int i = 0; i < n; ++i) {
      const int j = j0 + i;
      const float* kp = kc + table[j / BS] * block_elems + (int64_t)(j % BS) * KVH * D;
      if (j + AHEAD < len) prefetch_row(kc, table, j + AHEAD, kv0, kv1, KVH, D, BS, block_elems);
      for (int h = 0; h < nh; ++h) {
        float x = dot(q + (int64_t)(h0 + h) * D, kp + (int64_t)(kv0 + h / G) * D, D) * scale;
        if (softcap > 0.f) x = std::tanh(x / softcap) * softcap;
        s[h][i] = x;
      }
    }
    for (int h = 0; h < nh; ++h) {
      float mx = m[h];
      for (int i = 0; i < n; ++i) mx = std::max(mx, s[h][i]);
      const float r = fast_exp(m[h] - mx);
      l[h] *= r;
      for (int d = 0; d < D; ++d) acc[h][d] *= r;
      for (int i = 0; i < n; ++i) s[h][i] = fast_exp(s[h][i] - mx);
      for (int i = 0; i < n; ++i) l[h] += s[h][i];
      m[h] = mx;
    }
    for (int i = 0; i < n; ++i) {
      const int j = j0 + i;
      const float* vp = vc + table[j / BS] * block_elems + (int64_t)(j % BS) * KVH * D;
      if (j + AHEAD < len) prefetch_row(vc, table, j + AHEAD, kv0, kv1, KVH, D, BS, block_elems);
      for (int h = 0; h < nh; ++h) {
        const float p = s[h][i];
        const float* v = vp + (int64_t)(kv0 + h / G) * D;
        for (int d = 0; d < D; ++d) acc[h][d] += p * v[d];
      }
    }
  }
  for (int h = 0; h < nh; ++h) {
    const float inv = 1.f / l[h];
    for (int d = 0; d < D; ++d) out[(int64_t)(h0 + h) * D + d] = acc[h][d] * inv;
  }
}

}  // namespace

extern "C" {

// q [B, H, D] (rows q_row_stride apart, heads D apart), kv one layer [2, blocks, BS, KVH, D],
// tables [B, max_blocks] int32, lens [B] int32 -> out [B, H, D] contiguous. Work items are
// sequences, or (sequence, KV head) where there are fewer sequences than threads to share.
void hs_decode_attention(const float* q, int64_t q_row_stride, const float* kv, int64_t half_elems,
                         const int32_t* tables, int max_blocks, const int32_t* lens, float* out,
                         int B, int H, int KVH, int D, int BS, float scale, int window,
                         float softcap, int threads) {
  const int G = H / KVH;
  const int64_t block_elems = (int64_t)BS * KVH * D;
  const int split = B < 2 * threads ? KVH : 1;  // NOTE: pieces of KV heads per sequence
  const int per = (KVH + split - 1) / split;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int w = 0; w < B * split; ++w) {
    const int b = w / split, kv0 = (w % split) * per, kv1 = std::min(KVH, kv0 + per);
    attend_seq(q + b * q_row_stride, kv, kv + half_elems, tables + (int64_t)b * max_blocks,
               lens[b], kv0, kv1, G, KVH, D, BS, block_elems, scale, window, softcap,
               out + (int64_t)b * H * D);
  }
}

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

}  // extern "C"
