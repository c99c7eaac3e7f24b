// Y[n, rows] = X[n, cols] @ W.T for a bf16 W, accumulating in float32: the backbone's projections.
// A bf16 value widens to float exactly (a 16-bit shift), so this is float arithmetic on the stored
// weights, as transformers computes with them, only without a float32 copy in memory.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#include "mosaic/kernels.h"

namespace mosaic {
namespace {

constexpr int kTile = 4;

template <int NT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void row_avx512(const uint16_t* w, int cols, const float* x, int ldx,
                                                                 float* y, int ldy) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m512 wv = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c))), 16));
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + t * ldx + c), acc[t]);
  }
  if (c < cols) {
    const __mmask16 m = static_cast<__mmask16>((1u << (cols - c)) - 1);
    const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + c)), 16));
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + t * ldx + c), acc[t]);
  }
  for (int t = 0; t < NT; ++t) y[t * ldy] = _mm512_reduce_add_ps(acc[t]);
}

// AVX2: 16 columns a step in two accumulators per token; the tail through the scalar arithmetic.
template <int NT>
__attribute__((target("avx2,fma"))) void row_avx2(const uint16_t* w, int cols, const float* x, int ldx, float* y,
                                                  int ldy) {
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  int c = 0;
  for (; c + 16 <= cols; c += 16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
    for (int t = 0; t < NT; ++t) {
      acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * ldx + c), acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * ldx + c + 8), acc[t][1]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 v = _mm256_add_ps(acc[t][0], acc[t][1]);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    for (int j = c; j < cols; ++j) s += bf16_to_f32(w[j]) * x[t * ldx + j];
    y[t * ldy] = s;
  }
}

template <int NT>
void row_scalar(const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
  for (int t = 0; t < NT; ++t) {
    float s = 0.f;
    for (int c = 0; c < cols; ++c) s += bf16_to_f32(w[c]) * x[t * ldx + c];
    y[t * ldy] = s;
  }
}

template <int NT>
void row(Isa isa, const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
  if (isa == Isa::Avx512) row_avx512<NT>(w, cols, x, ldx, y, ldy);
  else if (isa == Isa::Avx2) row_avx2<NT>(w, cols, x, ldx, y, ldy);
  else row_scalar<NT>(w, cols, x, ldx, y, ldy);
}

}  // namespace

void linear_bf16(const uint16_t* w, int rows, int cols, const float* x, int n, float* y, int threads, Isa isa) {
  const Isa vec = vector_isa(isa);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const uint16_t* wr = w + static_cast<uint64_t>(r) * cols;
    int t0 = 0;
    for (; t0 + kTile <= n; t0 += kTile) row<kTile>(vec, wr, cols, x + static_cast<uint64_t>(t0) * cols, cols,
                                                    y + static_cast<uint64_t>(t0) * rows + r, rows);
    const float* xt = x + static_cast<uint64_t>(t0) * cols;
    float* yt = y + static_cast<uint64_t>(t0) * rows + r;
    switch (n - t0) {
      case 3: row<3>(vec, wr, cols, xt, cols, yt, rows); break;
      case 2: row<2>(vec, wr, cols, xt, cols, yt, rows); break;
      case 1: row<1>(vec, wr, cols, xt, cols, yt, rows); break;
      default: break;
    }
  }
}

}  // namespace mosaic
