// The Q4_G32 block encoder in AVX2: the scalar block's arithmetic (encode_q4.cpp) eight weights at a time,
// as encode_q4_avx512.cpp does sixteen, and eight blocks at once where a row has them; the same bytes for the
// same reasons (rounding to nearest even by vroundps, F16C conversions, exact sums). Compiled without FMA
// contraction, as encode_q4.cpp is.
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

// --- Eight blocks at once, a block in each lane (encode_q4_avx512.cpp's sixteen at half width) ------------
constexpr int kLaneBlocks = 8;

struct LaneFit {
  __m256 inv;              // 1 / d, or 0 where d is 0
  __m256d qw[2], qq[2], err[2];  // blocks 0-3 and 4-7
};

MOSAIC_AVX2 inline __m256d lo_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
MOSAIC_AVX2 inline __m256d hi_pd(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

MOSAIC_AVX2 inline void lane_fit(const __m256* v, __m128i d, LaneFit& f) {
  const __m256 d32 = _mm256_cvtph_ps(d);
  f.inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.f), d32),
                        _mm256_cmp_ps(d32, _mm256_setzero_ps(), _CMP_NEQ_UQ));
  __m256d qw0 = _mm256_setzero_pd(), qw1 = _mm256_setzero_pd();
  __m256 qq = _mm256_setzero_ps();
  for (int k = 0; k < 32; ++k) {
    const __m256 q = codes_of(v[k], f.inv);
    qq = _mm256_add_ps(qq, _mm256_mul_ps(q, q));  // integers up to 2048: exact
    qw0 = _mm256_add_pd(qw0, _mm256_mul_pd(lo_pd(q), lo_pd(v[k])));
    qw1 = _mm256_add_pd(qw1, _mm256_mul_pd(hi_pd(q), hi_pd(v[k])));
  }
  f.qw[0] = qw0, f.qw[1] = qw1, f.qq[0] = lo_pd(qq), f.qq[1] = hi_pd(qq);
  const __m256d two = _mm256_set1_pd(2.0);
  for (int h = 0; h < 2; ++h) {
    const __m256d d64 = h ? hi_pd(d32) : lo_pd(d32);
    f.err[h] = _mm256_sub_pd(_mm256_mul_pd(_mm256_mul_pd(d64, d64), f.qq[h]),
                             _mm256_mul_pd(_mm256_mul_pd(two, d64), f.qw[h]));
  }
}

// Blocks [0, 8) of `row` (256 columns, all present): their codes and scales, or false (nothing written) if any
// weight is not finite, which encode_block then reports block by block.
template <typename T>
MOSAIC_AVX2 bool encode_lane_blocks(const T* row, uint8_t* codes, uint16_t* scales, int& status) {
  alignas(32) float blocks[kLaneBlocks * 32];  // block b's element k at 32 b + k
  for (int i = 0; i < kLaneBlocks * 4; ++i) _mm256_store_ps(blocks + 8 * i, load8(row, 8 * i));
  const __m256i lane_at = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
  const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
  __m256 v[32];  // element k of every block
  __m256i bad = _mm256_setzero_si256();
  for (int k = 0; k < 32; ++k) {
    v[k] = _mm256_i32gather_ps(blocks + k, lane_at, 4);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v[k]), exp_mask), exp_mask));
  }
  if (!_mm256_testz_si256(bad, bad)) return false;
  __m256 hi = v[0], lo = v[0];
  for (int k = 1; k < 32; ++k) hi = _mm256_max_ps(hi, v[k]), lo = _mm256_min_ps(lo, v[k]);
  const __m256 neg_lo = _mm256_xor_ps(lo, _mm256_set1_ps(-0.f));
  __m256 extreme = _mm256_blendv_ps(hi, lo, _mm256_cmp_ps(neg_lo, hi, _CMP_GT_OQ));
  extreme = _mm256_and_ps(extreme, _mm256_cmp_ps(extreme, _mm256_setzero_ps(), _CMP_NEQ_UQ));  // +0 for zero
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m128i d0 = _mm256_cvtps_ph(_mm256_div_ps(extreme, _mm256_set1_ps(-8.f)), kNearest);
  LaneFit f0, f1;
  lane_fit(v, d0, f0);
  const __m256d one = _mm256_set1_pd(1.0);
  const __m128 r0 = _mm256_cvtpd_ps(_mm256_div_pd(f0.qw[0], _mm256_max_pd(f0.qq[0], one)));
  const __m128 r1 = _mm256_cvtpd_ps(_mm256_div_pd(f0.qw[1], _mm256_max_pd(f0.qq[1], one)));
  const __m128i d1 = _mm256_cvtps_ph(_mm256_insertf128_ps(_mm256_castps128_ps256(r0), r1, 1), kNearest);
  lane_fit(v, d1, f1);
  const int better = _mm256_movemask_pd(_mm256_cmp_pd(f1.err[0], f0.err[0], _CMP_LT_OQ)) |
                     (_mm256_movemask_pd(_mm256_cmp_pd(f1.err[1], f0.err[1], _CMP_LT_OQ)) << 4);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i pick = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(better), bit), bit);  // lanes of d1
  const __m256 inv = _mm256_blendv_ps(f0.inv, f1.inv, _mm256_castsi256_ps(pick));
  const __m128i pick16 = _mm_packs_epi32(_mm256_castsi256_si128(pick), _mm256_extracti128_si256(pick, 1));
  const __m128i d = _mm_blendv_epi8(d0, d1, pick16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), d);
  const __m128i exp_half = _mm_set1_epi16(0x7C00);
  if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(d, exp_half), exp_half)))
    status = std::max(status, static_cast<int>(EncodeStatus::ScaleOverflow));
  // Byte i of a block is code i | code i + 16 << 4, each plus 8: four bytes of every block a dword vector,
  // then the four interleaved so that each 128-bit lane holds one block's 16 bytes.
  const __m256i eight = _mm256_set1_epi32(8);
  __m256i dw[4];
  for (int j = 0; j < 4; ++j) {
    dw[j] = _mm256_setzero_si256();
    for (int i = 4 * j; i < 4 * j + 4; ++i) {
      const __m256i low = _mm256_add_epi32(_mm256_cvtps_epi32(codes_of(v[i], inv)), eight);
      const __m256i high = _mm256_add_epi32(_mm256_cvtps_epi32(codes_of(v[i + 16], inv)), eight);
      const __m256i byte = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
      dw[j] = _mm256_or_si256(dw[j], _mm256_slli_epi32(byte, 8 * (i - 4 * j)));
    }
  }
  const __m256i a = _mm256_unpacklo_epi32(dw[0], dw[1]), b = _mm256_unpackhi_epi32(dw[0], dw[1]);
  const __m256i c = _mm256_unpacklo_epi32(dw[2], dw[3]), e = _mm256_unpackhi_epi32(dw[2], dw[3]);
  const __m256i rows4[4] = {_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c), _mm256_unpacklo_epi64(b, e),
                            _mm256_unpackhi_epi64(b, e)};  // rows4[r], 128-bit lane q: block 4 q + r
  for (int r = 0; r < 4; ++r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * 16), _mm256_castsi256_si128(rows4[r]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (4 + r) * 16), _mm256_extracti128_si256(rows4[r], 1));
  }
  return true;
}

template <typename T>
MOSAIC_AVX2 int encode_row(const T* row, int cols, uint8_t* codes, uint16_t* scales) {
  int status = static_cast<int>(EncodeStatus::Ok);
  __m256 w[4];
  int b = 0, c0 = 0;
  for (; c0 + kLaneBlocks * 32 <= cols; c0 += kLaneBlocks * 32, b += kLaneBlocks)
    if (!encode_lane_blocks(row + c0, codes + b * 16, scales + b, status))
      for (int j = 0; j < kLaneBlocks; ++j) {  // a weight not finite: block by block, as below
        for (int i = 0; i < 4; ++i) w[i] = load8(row, c0 + 32 * j + 8 * i);
        status = std::max(status, encode_block(w, codes + (b + j) * 16, scales + b + j));
      }
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
