// The Q4_G32 block encoder in AVX-512: the scalar block's arithmetic (encode_q4.cpp) sixteen weights at a
// time. Elementwise float32 steps are the same operations, rounding to nearest even is vrndscaleps (the
// scalar's shift trick agrees with it wherever the clamp to [-8, 7] does not decide), the f16 conversions are
// F16C's (IEEE, to nearest even), and the float64 sums are exact, so any order gives the same bytes.
// Compiled without FMA contraction, as encode_q4.cpp is.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "encode_q4_block.h"
#include "mosaic/encode.h"
#include "mosaic/kernels.h"
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
  float extreme = -lo > hi ? lo : hi;  // the signed weight of largest magnitude
  if (extreme == 0.f) extreme = 0.f;  // +0 for an all-zero block, whichever zero the min and max met
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

// --- Sixteen blocks at once, a block in each lane ------------------------------------------------------
// encode_block spends most of its time in horizontal steps (a max, a min, four float64 sums, the scale's
// division and conversions, each through scalar code). Here a vector holds one element of 16 blocks, so every
// step is vertical and the 16 blocks' scales are computed together: the same operations lane by lane and
// the float32 sum of q * q exact (integers up to 2048), so the bytes are the scalar block's.
constexpr int kLaneBlocks = 16;

struct LaneFit {
  __m512 inv;           // 1 / d, or 0 where d is 0
  __m512d qw[2], err[2];  // blocks 0-7 and 8-15
  __m512d qq[2];
};

MOSAIC_AVX512 inline __m512d lo_pd(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
MOSAIC_AVX512 inline __m512d hi_pd(__m512 v) { return _mm512_cvtps_pd(upper_half(v)); }

MOSAIC_AVX512 inline void lane_fit(const __m512* v, __m256i d, LaneFit& f) {
  const __m512 d32 = _mm512_cvtph_ps(d);
  f.inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d32, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.f), d32);
  __m512d qw0 = _mm512_setzero_pd(), qw1 = _mm512_setzero_pd();
  __m512 qq = _mm512_setzero_ps();
  for (int k = 0; k < kQ4; ++k) {
    const __m512 q = codes_of(v[k], f.inv);
    qq = _mm512_add_ps(qq, _mm512_mul_ps(q, q));
    qw0 = _mm512_add_pd(qw0, _mm512_mul_pd(lo_pd(q), lo_pd(v[k])));
    qw1 = _mm512_add_pd(qw1, _mm512_mul_pd(hi_pd(q), hi_pd(v[k])));
  }
  f.qw[0] = qw0, f.qw[1] = qw1, f.qq[0] = lo_pd(qq), f.qq[1] = hi_pd(qq);
  const __m512d two = _mm512_set1_pd(2.0);
  for (int h = 0; h < 2; ++h) {
    const __m512d d64 = h ? hi_pd(d32) : lo_pd(d32);
    f.err[h] = _mm512_sub_pd(_mm512_mul_pd(_mm512_mul_pd(d64, d64), f.qq[h]),
                             _mm512_mul_pd(_mm512_mul_pd(two, d64), f.qw[h]));
  }
}

// Blocks [0, 16) of `row` (512 columns, all present): their codes and scales, or false (nothing written) if
// any weight is not finite, which encode_block then reports block by block.
template <typename T>
MOSAIC_AVX512 bool encode_lane_blocks(const T* row, uint8_t* codes, uint16_t* scales, int& status) {
  alignas(64) float blocks[kLaneBlocks * kQ4];  // block b's element k at 32 b + k
  for (int b = 0; b < kLaneBlocks; ++b) {
    _mm512_store_ps(blocks + b * kQ4, load16(row, b * kQ4, kLaneBlocks * kQ4));
    _mm512_store_ps(blocks + b * kQ4 + 16, load16(row, b * kQ4 + 16, kLaneBlocks * kQ4));
  }
  const __m512i lane_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(kQ4));
  __m512 v[kQ4];  // element k of every block
  const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
  __mmask16 bad = 0;
  for (int k = 0; k < kQ4; ++k) {
    v[k] = _mm512_i32gather_ps(_mm512_add_epi32(lane_at, _mm512_set1_epi32(k)), blocks, 4);
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v[k]), exp_mask), exp_mask);
  }
  if (bad) return false;
  __m512 hi = v[0], lo = v[0];
  for (int k = 1; k < kQ4; ++k) hi = _mm512_max_ps(hi, v[k]), lo = _mm512_min_ps(lo, v[k]);
  const __m512 neg_lo = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(lo), _mm512_set1_epi32(INT32_MIN)));
  __m512 extreme = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(neg_lo, hi, _CMP_GT_OQ), hi, lo);
  extreme = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(extreme, _mm512_setzero_ps(), _CMP_NEQ_UQ), extreme);  // +0
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256i d0 = _mm512_cvtps_ph(_mm512_div_ps(extreme, _mm512_set1_ps(-8.f)), kNearest);
  LaneFit f0, f1;
  lane_fit(v, d0, f0);
  const __m512d one = _mm512_set1_pd(1.0);
  const __m256 r0 = _mm512_cvtpd_ps(_mm512_div_pd(f0.qw[0], _mm512_max_pd(f0.qq[0], one)));
  const __m256 r1 = _mm512_cvtpd_ps(_mm512_div_pd(f0.qw[1], _mm512_max_pd(f0.qq[1], one)));
  const __m512 refit =
      _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(r0)), _mm256_castps_pd(r1), 1));
  const __m256i d1 = _mm512_cvtps_ph(refit, kNearest);
  lane_fit(v, d1, f1);
  const __mmask16 better = static_cast<__mmask16>(_mm512_cmp_pd_mask(f1.err[0], f0.err[0], _CMP_LT_OQ) |
                                                  (_mm512_cmp_pd_mask(f1.err[1], f0.err[1], _CMP_LT_OQ) << 8));
  const __m256i d = _mm256_mask_blend_epi16(better, d0, d1);
  const __m512 inv = _mm512_mask_blend_ps(better, f0.inv, f1.inv);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(scales), d);
  const __m256i exp_half = _mm256_set1_epi16(0x7C00);
  if (_mm256_cmpeq_epi16_mask(_mm256_and_si256(d, exp_half), exp_half))
    status = std::max(status, static_cast<int>(EncodeStatus::ScaleOverflow));
  // Byte i of a block is code i | code i + 16 << 4, each plus 8: four bytes of every block a dword vector,
  // then the four vectors interleaved so that each 128-bit lane holds one block's 16 bytes.
  const __m512i eight = _mm512_set1_epi32(8);
  __m512i dw[4];
  for (int j = 0; j < 4; ++j) {
    dw[j] = _mm512_setzero_si512();
    for (int i = 4 * j; i < 4 * j + 4; ++i) {
      const __m512i low = _mm512_add_epi32(_mm512_cvtps_epi32(codes_of(v[i], inv)), eight);
      const __m512i high = _mm512_add_epi32(_mm512_cvtps_epi32(codes_of(v[i + 16], inv)), eight);
      const __m512i byte = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
      dw[j] = _mm512_or_si512(dw[j], _mm512_slli_epi32(byte, 8 * (i - 4 * j)));
    }
  }
  const __m512i a = _mm512_unpacklo_epi32(dw[0], dw[1]), b = _mm512_unpackhi_epi32(dw[0], dw[1]);
  const __m512i c = _mm512_unpacklo_epi32(dw[2], dw[3]), e = _mm512_unpackhi_epi32(dw[2], dw[3]);
  const __m512i rows4[4] = {_mm512_unpacklo_epi64(a, c), _mm512_unpackhi_epi64(a, c), _mm512_unpacklo_epi64(b, e),
                            _mm512_unpackhi_epi64(b, e)};  // rows4[r], 128-bit lane q: block 4 q + r
  for (int r = 0; r < 4; ++r) {
    alignas(64) uint8_t lanes[64];
    _mm512_store_si512(lanes, rows4[r]);
    for (int q = 0; q < 4; ++q) std::memcpy(codes + (4 * q + r) * 16, lanes + 16 * q, 16);
  }
  return true;
}

template <typename T>
MOSAIC_AVX512 int encode_row(const T* row, int cols, uint8_t* codes, uint16_t* scales) {
  int status = static_cast<int>(EncodeStatus::Ok);
  int b = 0, c0 = 0;
  for (; c0 + kLaneBlocks * kQ4 <= cols; c0 += kLaneBlocks * kQ4, b += kLaneBlocks) {
    if (encode_lane_blocks(row + c0, codes + b * 16, scales + b, status)) continue;
    for (int j = 0; j < kLaneBlocks; ++j)  // a weight not finite: block by block, as below
      status = std::max(status, encode_block(load16(row, c0 + j * kQ4, cols), load16(row, c0 + j * kQ4 + 16, cols),
                                             codes + (b + j) * 16, scales + b + j));
  }
  for (; c0 < cols; ++b, c0 += kQ4)
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
