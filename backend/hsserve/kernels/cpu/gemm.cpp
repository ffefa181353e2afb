// y = x W^T (+ b) in float32 for the CPU's linears, W packed once into panels of NR columns
// ([panels][K][NR], zero past N): a panel's K x NR block streams contiguously and, while up to
// MR rows of x use it, its columns stay in registers. Each y element is one chain of FMAs over
// k = 0..K-1, whatever the row count or the thread split: a row's bits never depend on the batch.
#include <cstdint>
#include <algorithm>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int NR = 48;
constexpr int64_t SERIAL_MACS = 1 << 16;  // NOTE: below this a product runs on one thread

#if defined(__AVX512F__)
constexpr int MR = 8;  // NOTE: 8 rows x 3 vectors: 24 accumulators of the 32 registers

template <int R>
void tile(const float* x, int64_t ldx, const float* wp, int K, float* y, int64_t ldy, int ncols,
          const float* bias) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const float* b = wp + (int64_t)k * NR;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16),
                 b2 = _mm512_loadu_ps(b + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
    }
  }
  for (int j = 0; j < 3 && j * 16 < ncols; ++j) {
    const int left = ncols - j * 16;
    const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 bb = bias ? _mm512_maskz_loadu_ps(m, bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(y + r * ldy + j * 16, m, _mm512_add_ps(acc[r][j], bb));
  }
}
#else
constexpr int MR = 2;  // NOTE: the compiler's vectors (AVX2 or narrower) hold 2 x 48 sums

template <int R>
void tile(const float* x, int64_t ldx, const float* wp, int K, float* y, int64_t ldy, int ncols,
          const float* bias) {
  float acc[R][NR] = {};
  for (int k = 0; k < K; ++k) {
    const float* b = wp + (int64_t)k * NR;
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int j = 0; j < NR; ++j) acc[r][j] += a * b[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < ncols; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.f);
}
#endif

template <int R>
void rows(const float* x, int64_t ldx, const float* wp, int K, float* y, int64_t ldy, int ncols,
          const float* bias, int m) {
  if (m == R) return tile<R>(x, ldx, wp, K, y, ldy, ncols, bias);
  if constexpr (R > 1) rows<R - 1>(x, ldx, wp, K, y, ldy, ncols, bias, m);
}

}  // namespace

extern "C" {

// w [N, K] row-major -> packed [ceil(N / NR)][K][NR], zero-padded past N.
void hs_gemm_pack(const float* w, float* packed, int N, int K, int threads) {
  const int panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < panels; ++p) {
    float* dst = packed + (int64_t)p * K * NR;
    for (int k = 0; k < K; ++k)
      for (int j = 0; j < NR; ++j) {
        const int n = p * NR + j;
        dst[(int64_t)k * NR + j] = n < N ? w[(int64_t)n * K + k] : 0.f;
      }
  }
}

// x [M, K] (rows ldx apart), packed from hs_gemm_pack, bias [N] or null -> y [M, N] (rows ldy
// apart). Threads take whole panels; each panel serves every row block of MR in turn.
void hs_gemm(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
             int64_t ldy, int M, int N, int K, int threads) {
  const int panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if ((int64_t)M * N * K > SERIAL_MACS)
  for (int p = 0; p < panels; ++p) {
    const float* wp = packed + (int64_t)p * K * NR;
    const int ncols = std::min(NR, N - p * NR);
    const float* b = bias ? bias + p * NR : nullptr;
    for (int m = 0; m < M; m += MR)
      rows<MR>(x + m * ldx, ldx, wp, K, y + m * ldy + p * NR, ldy, ncols, b, std::min(MR, M - m));
  }
}

}  // extern "C"
