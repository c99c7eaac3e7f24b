// The backbone's rows in AVX2 (backbone_rows.h): the AVX-512 loops at half width, tails through the
// scalar arithmetic.
#include <immintrin.h>

#include "backbone_rows.h"
#include "simd_avx2.h"

namespace mosaic::detail {
namespace {

// AVX2: 16 columns a step in two accumulators per token; the tail through the scalar arithmetic.
template <int NT>
MOSAIC_AVX2 void bf16_row(const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
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

// 8 codes widened to float, as widen_i8 / e4m3x16 do at 16.
MOSAIC_AVX2 inline __m256 widen8_avx2(const uint8_t* p, bool fp8) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (!fp8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m128i h16 = _mm_cvtepu8_epi16(b);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h16, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(h16, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}

// AVX2: the AVX-512 code_row at half width (32 codes a step, four accumulators per token); the tail through the
// scalar arithmetic.
template <int NT, bool Fp8>
MOSAIC_AVX2 void code_row(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  __m256 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_ps();
  int c = 0;
  for (; c + 32 <= cols; c += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c + 1024), _MM_HINT_T0);
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = widen8_avx2(w + c + 8 * j, Fp8);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * ldx + c + 8 * j), acc[t][j]);
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 v = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    if (Fp8) s *= 256.f;  // the f16 route's 2^-8, undone before the exact tail joins
    for (int j = c; j < cols; ++j)
      s += code_value<Fp8>(w[j]) * x[t * ldx + j];
    y[t * ldy] = scale * s;
  }
}

template <bool Fp8>
void code_rows(const uint8_t* w, int cols, const float* x, int ldx, int nt, float scale, float* y, int ldy) {
  for_tokens(nt, [&](auto NT) { code_row<decltype(NT)::value, Fp8>(w, cols, x, ldx, scale, y, ldy); });
}

void bf16_rows(const uint16_t* w, int nrows, int cols, const float* x, int ldx, int nt, float* y, int ldy) {
  for (int i = 0; i < nrows; ++i)
    for_tokens(nt, [&](auto NT) { bf16_row<decltype(NT)::value>(w + i * cols, cols, x, ldx, y + i, ldy); });
}

}  // namespace

BackboneRows backbone_rows_avx2() { return {bf16_rows, code_rows<false>, code_rows<true>}; }

}  // namespace mosaic::detail
