// The backbone's rows in AVX-512 (backbone_rows.h): bf16 widened by a shift, int8 and E4M3 codes widened
// to float (E4M3 through f16), 16 columns a vector.
#include <immintrin.h>

#include <algorithm>

#include "backbone_rows.h"
#include "simd_avx512.h"

namespace mosaic::detail {
namespace {

// NR rows against NT tokens, one accumulator a row and token (NR x NT independent FMA chains): a token's
// activations, loaded once a step, feed every row. One row at a time, four chains waited on the FMA's latency
// and each row re-read its tokens' activations from L2 (a 256-row router over 512 tokens at 48 GMAC/s on two
// threads).
template <int NR, int NT>
MOSAIC_AVX512 void bf16_row(const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
  __m512 acc[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 16 <= cols; c += 16) {  // (a lambda for this step and the tail's kept acc in memory)
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i)
      wv[i] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * cols + c))), 16));
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * ldx + c);
      for (int i = 0; i < NR; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  if (c < cols) {
    const __mmask16 m = static_cast<__mmask16>((1u << (cols - c)) - 1);
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i)
      wv[i] = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i * cols + c)), 16));
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + t * ldx + c);
      for (int i = 0; i < NR; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) y[t * ldy + i] = _mm512_reduce_add_ps(acc[i][t]);
}

// 16 codes widened to float: int8 exactly; E4M3 through f16 (e4m3x16: the value times 2^-8, undone by
// the 256 in the scale).
MOSAIC_AVX512 inline __m512 widen_i8(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

template <int NT, bool Fp8>
MOSAIC_AVX512 void code_row(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  // Four accumulators per token over 64 codes a step: independent FMA chains, so the loop is bound by
  // loads, not by FMA latency.
  __m512 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 64 <= cols; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c + 1024), _MM_HINT_T0);
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = Fp8 ? e4m3x16(w + c + 16 * j, 0xFFFF) : widen_i8(w + c + 16 * j, 0xFFFF);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(x + t * ldx + c + 16 * j), acc[t][j]);
  }
  for (; c < cols; c += 16) {
    const int len = std::min(16, cols - c);
    const __mmask16 m = len == 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
    const __m512 wv = Fp8 ? e4m3x16(w + c, m) : widen_i8(w + c, m);
    for (int t = 0; t < NT; ++t) acc[t][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + t * ldx + c), acc[t][0]);
  }
  for (int t = 0; t < NT; ++t)
    y[t * ldy] = scale * _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                                            _mm512_add_ps(acc[t][2], acc[t][3])));
}

template <bool Fp8>
void code_rows(const uint8_t* w, int cols, const float* x, int ldx, int nt, float scale, float* y, int ldy) {
  // The f16 route yields E4M3 values times 2^-8: the scale takes the 256 back.
  const float s = Fp8 ? scale * 256.f : scale;
  for_tokens(nt, [&](auto NT) { code_row<decltype(NT)::value, Fp8>(w, cols, x, ldx, s, y, ldy); });
}

void bf16_rows(const uint16_t* w, int nrows, int cols, const float* x, int ldx, int nt, float* y, int ldy) {
  static_assert(kBf16Rows == 4, "the row counts below");
  for_tokens(nt, [&](auto NT) {
    constexpr int nt_ = decltype(NT)::value;
    switch (nrows) {
      case 4: bf16_row<4, nt_>(w, cols, x, ldx, y, ldy); break;
      case 3: bf16_row<3, nt_>(w, cols, x, ldx, y, ldy); break;
      case 2: bf16_row<2, nt_>(w, cols, x, ldx, y, ldy); break;
      default: bf16_row<1, nt_>(w, cols, x, ldx, y, ldy); break;
    }
  });
}

}  // namespace

BackboneRows backbone_rows_avx512() { return {bf16_rows, code_rows<false>, code_rows<true>}; }

}  // namespace mosaic::detail
