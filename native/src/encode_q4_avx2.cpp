// The Q4_G32 block encoder in AVX2: the scalar block's arithmetic (encode_q4.cpp) eight weights at a time,
// as encode_q4_avx512.cpp does sixteen; the same bytes for the same reasons (rounding to nearest even by
// vroundps, F16C conversions, exact float64 sums). Compiled without FMA contraction, as encode_q4.cpp is.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "encode_q4_block.h"
#include "mosaic/encode.h"
#include "simd_avx2.h"

namespace mosaic::detail {
namespace {

struct Fit {
  __m256 q[4];  // the codes of elements 8i..8i+7, as floats in [-8, 7]
  double qw, qq, err;
};

MOSAIC_AVX2 inline float from_half(uint16_t h) { return _cvtsh_ss(h); }
MOSAIC_AVX2 inline uint16_t to_half(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

MOSAIC_AVX2 inline __m256 codes_of(__m256 w, __m256 inv) {
  const __m256 x = _mm256_round_ps(_mm256_mul_ps(w, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-8.f)), _mm256_set1_ps(7.f));
}

// sum(a * b) over 8 floats in float64, as four lanes: each product and the sum are exact here.
MOSAIC_AVX2 inline __m256d dot_pd(__m256 a, __m256 b) {
  const __m256d lo = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                                   _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
  const __m256d hi = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)),
                                   _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
  return _mm256_add_pd(lo, hi);
}

MOSAIC_AVX2 inline double reduce(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

MOSAIC_AVX2 inline float reduce_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

MOSAIC_AVX2 inline float reduce_min(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

MOSAIC_AVX2 inline void fit(const __m256* w, uint16_t d, Fit& f) {
  const float d32 = from_half(d), inv = d32 != 0.f ? 1.f / d32 : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256d qw = _mm256_setzero_pd(), qq = _mm256_setzero_pd();
  for (int i = 0; i < 4; ++i) {
    f.q[i] = codes_of(w[i], vinv);
    qw = _mm256_add_pd(qw, dot_pd(f.q[i], w[i]));
    qq = _mm256_add_pd(qq, dot_pd(f.q[i], f.q[i]));
  }
  f.qw = reduce(qw);
  f.qq = reduce(qq);
  const double d64 = d32;
  f.err = d64 * d64 * f.qq - 2 * d64 * f.qw;
}

// Eight weights from column c of a row with at least eight left, as float32: as they are, or widened from
// bf16 bits.
MOSAIC_AVX2 inline __m256 load8(const float* row, int c) { return _mm256_loadu_ps(row + c); }
MOSAIC_AVX2 inline __m256 load8(const uint16_t* row, int c) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

MOSAIC_AVX2 inline int encode_block(const __m256* w, uint8_t* codes, uint16_t* scale) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i)  // not finite: the exponent field is all ones
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(w[i]), exp_mask), exp_mask));
  if (!_mm256_testz_si256(bad, bad)) return static_cast<int>(EncodeStatus::NotFinite);
  const float hi = reduce_max(_mm256_max_ps(_mm256_max_ps(w[0], w[1]), _mm256_max_ps(w[2], w[3])));
  const float lo = reduce_min(_mm256_min_ps(_mm256_min_ps(w[0], w[1]), _mm256_min_ps(w[2], w[3])));
  float extreme = -lo > hi ? lo : hi;  // the signed weight of largest magnitude
  if (extreme == 0.f) extreme = 0.f;  // +0 for an all-zero block, whichever zero the min and max met
  Fit f0, f1;
  const uint16_t d0 = to_half(extreme / -8.f);
  fit(w, d0, f0);
  const uint16_t d1 = to_half(static_cast<float>(f0.qw / std::max(f0.qq, 1.0)));
  fit(w, d1, f1);
  const bool better = f1.err < f0.err;
  const uint16_t d = better ? d1 : d0;
  const Fit& f = better ? f1 : f0;
  // byte j: the code of element j in the low nibble, of element j + 16 in the high one (each plus 8)
  const __m256i eight = _mm256_set1_epi32(8);
  __m256i v[2];
  for (int i = 0; i < 2; ++i)
    v[i] = _mm256_or_si256(_mm256_add_epi32(_mm256_cvtps_epi32(f.q[i]), eight),
                           _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(f.q[i + 2]), eight), 4));
  const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);  // v0's 8, then v1's 8
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes),
                   _mm_packus_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
  *scale = d;
  return static_cast<int>((d & 0x7C00u) == 0x7C00u ? EncodeStatus::ScaleOverflow : EncodeStatus::Ok);
}

template <typename T>
MOSAIC_AVX2 int encode_row(const T* row, int cols, uint8_t* codes, uint16_t* scales) {
  int status = static_cast<int>(EncodeStatus::Ok);
  __m256 w[4];
  int b = 0, c0 = 0;
  for (; c0 + 32 <= cols; ++b, c0 += 32) {
    for (int i = 0; i < 4; ++i) w[i] = load8(row, c0 + 8 * i);
    status = std::max(status, encode_block(w, codes + b * 16, scales + b));
  }
  if (c0 < cols) {  // a partial last block, padded with zeros
    T tail[32] = {};
    std::memcpy(tail, row + c0, (cols - c0) * sizeof(T));
    for (int i = 0; i < 4; ++i) w[i] = load8(tail, 8 * i);
    status = std::max(status, encode_block(w, codes + b * 16, scales + b));
  }
  return status;
}

}  // namespace

MOSAIC_AVX2 int encode_q4_row_avx2(const float* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

MOSAIC_AVX2 int encode_q4_row_avx2(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

}  // namespace mosaic::detail
