// The Q4_G32 block encoder in AVX-512: the scalar block's arithmetic (encode_q4.cpp) sixteen weights at a
// time. Elementwise float32 steps are the same operations, rounding to nearest even is vrndscaleps (the
// scalar's shift trick agrees with it wherever the clamp to [-8, 7] does not decide), the f16 conversions are
// F16C's (IEEE, to nearest even), and the float64 sums are exact, so any order gives the same bytes.
// Compiled without FMA contraction, as encode_q4.cpp is.
#include <immintrin.h>

#include <algorithm>

#include "encode_q4_block.h"
#include "mosaic/encode.h"
#include "simd_avx512.h"

namespace mosaic::detail {
namespace {

struct Fit {
  __m512 q0, q1;  // the codes of elements 0..15 and 16..31, as floats in [-8, 7]
  double qw, qq, err;
};

MOSAIC_AVX512 inline float from_half(uint16_t h) { return _cvtsh_ss(h); }
MOSAIC_AVX512 inline uint16_t to_half(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

MOSAIC_AVX512 inline __m512 codes_of(__m512 w, __m512 inv) {
  const __m512 x = _mm512_roundscale_ps(_mm512_mul_ps(w, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-8.f)), _mm512_set1_ps(7.f));
}

MOSAIC_AVX512 inline __m256 upper_half(__m512 v) {  // AVX-512F alone (vextractf32x8 needs DQ)
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

// sum(a * b) over 16 floats in float64: each product and the sum are exact here (encode_q4.cpp).
MOSAIC_AVX512 inline __m512d dot_pd(__m512 a, __m512 b) {
  const __m512d lo = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(a)),
                                   _mm512_cvtps_pd(_mm512_castps512_ps256(b)));
  const __m512d hi = _mm512_mul_pd(_mm512_cvtps_pd(upper_half(a)),
                                   _mm512_cvtps_pd(upper_half(b)));
  return _mm512_add_pd(lo, hi);
}

MOSAIC_AVX512 inline void fit(__m512 w0, __m512 w1, uint16_t d, Fit& f) {
  const float d32 = from_half(d), inv = d32 != 0.f ? 1.f / d32 : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  f.q0 = codes_of(w0, vinv);
  f.q1 = codes_of(w1, vinv);
  f.qw = _mm512_reduce_add_pd(_mm512_add_pd(dot_pd(f.q0, w0), dot_pd(f.q1, w1)));
  f.qq = _mm512_reduce_add_pd(_mm512_add_pd(dot_pd(f.q0, f.q0), dot_pd(f.q1, f.q1)));
  const double d64 = d32;
  f.err = d64 * d64 * f.qq - 2 * d64 * f.qw;
}

// Sixteen weights from column c of a row, as float32: loaded as they are, or widened from bf16 bits;
// columns past `cols` read as zeros (the padding of a partial block).
MOSAIC_AVX512 inline __m512 load16(const float* row, int c, int cols) {
  const int n = std::clamp(cols - c, 0, 16);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), row + c);
}
MOSAIC_AVX512 inline __m512 load16(const uint16_t* row, int c, int cols) {
  const int n = std::clamp(cols - c, 0, 16);
  const __m256i bits = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), row + c);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

MOSAIC_AVX512 inline int encode_block(__m512 w0, __m512 w1, uint8_t* codes, uint16_t* scale) {
  // finite: the exponent field is not all ones
  const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
  const __mmask16 bad0 = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(w0), exp_mask), exp_mask);
  const __mmask16 bad1 = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(w1), exp_mask), exp_mask);
  if (bad0 | bad1) return static_cast<int>(EncodeStatus::NotFinite);
  const float hi = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1)), lo = _mm512_reduce_min_ps(_mm512_min_ps(w0, w1));
  const float extreme = -lo > hi ? lo : hi;  // the signed weight of largest magnitude
  Fit f0, f1;
  const uint16_t d0 = to_half(extreme / -8.f);
  fit(w0, w1, d0, f0);
  const uint16_t d1 = to_half(static_cast<float>(f0.qw / std::max(f0.qq, 1.0)));
  fit(w0, w1, d1, f1);
  const bool better = f1.err < f0.err;
  const uint16_t d = better ? d1 : d0;
  const Fit& f = better ? f1 : f0;
  const __m512i eight = _mm512_set1_epi32(8);
  const __m512i low = _mm512_add_epi32(_mm512_cvtps_epi32(f.q0), eight);
  const __m512i high = _mm512_add_epi32(_mm512_cvtps_epi32(f.q1), eight);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes),
                   _mm512_cvtepi32_epi8(_mm512_or_si512(low, _mm512_slli_epi32(high, 4))));
  *scale = d;
  return static_cast<int>((d & 0x7C00u) == 0x7C00u ? EncodeStatus::ScaleOverflow : EncodeStatus::Ok);
}

template <typename T>
MOSAIC_AVX512 int encode_row(const T* row, int cols, uint8_t* codes, uint16_t* scales) {
  int status = static_cast<int>(EncodeStatus::Ok);
  for (int b = 0, c0 = 0; c0 < cols; ++b, c0 += 32)
    status = std::max(status, encode_block(load16(row, c0, cols), load16(row, c0 + 16, cols), codes + b * 16,
                                           scales + b));
  return status;
}

}  // namespace

MOSAIC_AVX512 int encode_q4_row_avx512(const float* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

MOSAIC_AVX512 int encode_q4_row_avx512(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

}  // namespace mosaic::detail
