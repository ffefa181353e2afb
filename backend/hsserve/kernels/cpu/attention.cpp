// Paged decode attention straight from the cache blocks (no gather, no mask).
#include "common.h"

namespace {

using hs::dot;
using hs::fast_exp;

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

}  // extern "C"
