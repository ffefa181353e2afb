// Shared by the CPU kernels (kernels/cpu/*.cpp, one library called through ctypes: cpu_ops.py).
// Built with -ffp-contract=off: each product and sum rounds as torch's separate ops do.
#pragma once
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace hs {


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

}  // namespace hs
