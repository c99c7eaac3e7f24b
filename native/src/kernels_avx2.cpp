// AVX2 kernels: the AVX-512 ones at half width; partial blocks and tails go through the scalar
// arithmetic of the reference. Plus Q4 against int8 activations (Isa::Avx2Int8), llama.cpp's AVX2 route
// for Q4_0: unsigned codes times signed activations with vpmaddubsw, pairs summed with vpmaddwd.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mosaic/kernels.h"

#include "prefill_blocks.h"
#include "simd_avx2.h"

namespace mosaic {
namespace {

constexpr int kTokTile = 4;
constexpr int kPrefetch = 4096;

using avx2::reduce;
using avx2::broadcast_dword;

MOSAIC_AVX2 inline __m256 widen8(__m128i bytes, __m256 d) {  // 8 nibble codes -> d * (q - 8)
  return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(8.f)), d);
}

// 8 E2M1 codes (one a byte) as floats: the magnitude through an 8-entry table, the sign bit moved to bit 31.
MOSAIC_AVX2 inline __m256 e2m1x8(__m128i codes, __m256 lut) {
  const __m256i c = _mm256_cvtepu8_epi32(codes);
  const __m256 mag = _mm256_permutevar8x32_ps(lut, c);  // uses the low 3 bits
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(c, 3), 31)));
}

// A block's scale: Q4's f16 or MXFP4's E8M0.
template <bool Mx>
MOSAIC_AVX2 inline float block_scale(const void* scales, uint64_t i) {
  if constexpr (Mx) return e8m0_to_f32(static_cast<const uint8_t*>(scales)[i]);
  else return _cvtsh_ss(static_cast<const uint16_t*>(scales)[i]);
}

// Q4 and MXFP4 in float: a block's 32 codes widened to floats 8 at a time in element order, times the
// block's scale (Q4: f16, d * (q - 8), byte j holding elements j and j + 16; MXFP4: E8M0 times E2M1, byte j
// holding elements 2j and 2j + 1), against up to four tokens; the partial last block through the
// reference's arithmetic.
template <bool Mx>
MOSAIC_AVX2 void nibble_avx2(const MatvecArgs& a) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  const int whole = a.cols / kQ4;
  const __m256 lut = _mm256_loadu_ps(kE2m1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint64_t s0 = static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m256 acc[kTokTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int b = 0; b < whole; ++b) {
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + b * 16 + kPrefetch), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        const __m256 d = _mm256_set1_ps(block_scale<Mx>(a.scales, s0 + b));
        __m256 w[4];
        if constexpr (Mx) {
          const __m128i e0 = _mm_unpacklo_epi8(lo, hi), e1 = _mm_unpackhi_epi8(lo, hi);  // elements 0-15, 16-31
          w[0] = _mm256_mul_ps(e2m1x8(e0, lut), d), w[1] = _mm256_mul_ps(e2m1x8(_mm_srli_si128(e0, 8), lut), d);
          w[2] = _mm256_mul_ps(e2m1x8(e1, lut), d), w[3] = _mm256_mul_ps(e2m1x8(_mm_srli_si128(e1, 8), lut), d);
        } else {
          w[0] = widen8(lo, d), w[1] = widen8(_mm_srli_si128(lo, 8), d);
          w[2] = widen8(hi, d), w[3] = widen8(_mm_srli_si128(hi, 8), d);
        }
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + b * kQ4;
          for (int j = 0; j < 4; ++j) acc[t] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[t]);
        }
      }
      for (int t = 0; t < nt; ++t) {
        float s = reduce(acc[t]);
        if (whole < blocks) {  // the partial last block
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + whole * kQ4;
          const uint8_t* p = row + whole * 16;
          const int len = a.cols - whole * kQ4;
          s += block_scale<Mx>(a.scales, s0 + whole) * (Mx ? mxfp4_partial_dot(p, x, len) : q4_partial_dot(p, x, len));
        }
        a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = s;
      }
    }
  }
}

MOSAIC_AVX2 inline __m256 e4m3x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);  // value * 2^-8, see kernels_avx512.cpp
}

MOSAIC_AVX2 void fp8_avx2(const MatvecArgs& a) {
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    const uint64_t srow = static_cast<uint64_t>(r / kFp8) * scale_cols;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      float total[kTokTile] = {0.f, 0.f, 0.f, 0.f};
      for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
        const int end = std::min(c0 + kFp8, a.cols), vec_end = c0 + (end - c0) / 8 * 8;
        __m256 acc[kTokTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int c = c0; c < vec_end; c += 8) {
          if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + c + kPrefetch), _MM_HINT_T0);
          const __m256 w = e4m3x8(row + c);
          for (int t = 0; t < nt; ++t)
            acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c), acc[t]);
        }
        const float s = scale_at(a.scales, a.scale_dtype, srow + c0 / kFp8);
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx;
          float tail = 0.f;
          for (int c = vec_end; c < end; ++c) tail += e4m3_to_f32(row[c]) * x[c];
          total[t] += (reduce(acc[t]) * 256.f + tail) * s;
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = total[t];
    }
  }
}

// --- Q4 and MXFP4 with int8 activations (int8_avx2_loops.h) ------------------------------------------
// vpmaddubsw sums code x activation pairs into int16 (at most 2 x 24 x 127 a pair, 12,192 for the low and
// high halves added: no saturation), vpmaddwd sums those pairs into int32.
#define MOSAIC_INT8_TARGET MOSAIC_AVX2
MOSAIC_AVX2 inline __m256i pair_dots(__m256i lo, __m256i ql, __m256i hi, __m256i qh) {
  const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ql), _mm256_maddubs_epi16(hi, qh));
  return _mm256_madd_epi16(pairs16, _mm256_set1_epi16(1));
}
// A block's dot products for NT tokens, rows in lanes (int8_avx2_loops.h). Q4's eight vpmaddubsw of a token
// add in int16 (codes 0..15: at most 8 x 2 x 15 x 127 = 30,480, no saturation) and widen with one vpmaddwd;
// MXFP4's codes reach 24, so each half of four widens on its own (at most 24,384), and a token group is
// four, to keep the int16 and int32 sums of every token in registers.
template <bool Mx>
constexpr int kLaneTokens = Mx ? 4 : 6;

// a + b in int16, in the order written: GCC otherwise reassociates a token's adds into a tree over all of a
// block's products, which holds every product at once and spills them.
MOSAIC_AVX2 inline __m256i add16_in_order(__m256i a, __m256i b) {
  __m256i r = _mm256_add_epi16(a, b);
  __asm__("" : "+x"(r));
  return r;
}

template <int NT, bool Mx>
MOSAIC_AVX2 inline void block_dots(const int32_t* w, const int8_t* q, const int32_t* neg_zsum, __m256i (&sum)[NT]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s16[NT];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) sum[t] = _mm256_set1_epi32(neg_zsum[t]);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {  // k: the dword group, 0-3 low nibbles, 4-7 high
    const __m256i wk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * k));
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const __m256i p = _mm256_maddubs_epi16(wk, broadcast_dword(q + 32 * t + 4 * k));
      s16[t] = k == 0 || (Mx && k == 4) ? p : add16_in_order(s16[t], p);
    }
    if (k == 7 || (Mx && k == 3)) {
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(s16[t], ones));
    }
  }
}
#include "int8_avx2_loops.h"
#undef MOSAIC_INT8_TARGET

MOSAIC_AVX2 void q4_avx2_int8(const MatvecArgs& a) { int8_matvec<Q4Codes, uint16_t>(a); }
MOSAIC_AVX2 void mxfp4_avx2_int8(const MatvecArgs& a) { int8_matvec<Mxfp4Codes, uint8_t>(a); }

}  // namespace

IsaKernels avx2_kernels() { return {nibble_avx2<false>, fp8_avx2, nibble_avx2<true>}; }
IsaKernels avx2_int8_kernels() { return {q4_avx2_int8, fp8_avx2, mxfp4_avx2_int8}; }

}  // namespace mosaic
