// The AVX2 task of decode attention (attention_task.h): head_dim a multiple of 8. Keys outer and the
// group's query heads inner, so each key or value row is read from memory once and from L1 by the other
// heads; scores, then the softmax, then the values.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "attention_task.h"
#include "simd_avx2.h"

namespace mosaic {
namespace attention {
namespace {

MOSAIC_AVX2 inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
MOSAIC_AVX2 inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
MOSAIC_AVX2 inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename T>
MOSAIC_AVX2 void task(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1,
                      float* o, Partial* part) {
  thread_local std::vector<float> scores;  // [rep][k1 - k0]
  const int n = k1 - k0;
  scores.resize(static_cast<size_t>(rep) * n);
  for (int j = 0; j < n; ++j) {
    const T* kr = k + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(kr + 4 * d), _MM_HINT_T0);
    for (int r = 0; r < rep; ++r) {
      const float* qr = q + static_cast<int64_t>(r) * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int i = 0;
      for (; i + 16 <= d; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), widen8(kr + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), widen8(kr + i + 8), a1);
      }
      if (i < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), widen8(kr + i), a0);
      const __m256 a = _mm256_add_ps(a0, a1);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      const float dot = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      scores[static_cast<size_t>(r) * n + j] = rs.k ? dot * rs.k[k0 + j] : dot;
    }
  }
  softmax_rows(scores.data(), rep, n, rs.v ? rs.v + k0 : nullptr, part);
  std::fill(o, o + static_cast<int64_t>(rep) * d, 0.f);
  for (int j = 0; j < n; ++j) {
    const T* vr = v + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(vr + 4 * d), _MM_HINT_T0);
    for (int r = 0; r < rep; ++r) {
      const __m256 p = _mm256_set1_ps(scores[static_cast<size_t>(r) * n + j]);
      float* orow = o + static_cast<int64_t>(r) * d;
      for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(orow + i, _mm256_fmadd_ps(p, widen8(vr + i), _mm256_loadu_ps(orow + i)));
    }
  }
}

}  // namespace

void task_avx2(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx2(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx2(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace attention
}  // namespace mosaic
