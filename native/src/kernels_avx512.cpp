// AVX-512 kernels: nibbles/E4M3 widened to float in registers, FMA against up to 4 tokens at once,
// software prefetch a few KB ahead in the row (FACTS.md §3: it took Q4 blocks from 0.34 to 0.83 of the
// memory roofline in a prototype here).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "mosaic/kernels.h"

#define MOSAIC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace mosaic {
namespace {

constexpr int kTokTile = 4;
constexpr int kPrefetch = 4096;  // bytes ahead in the row stream

MOSAIC_AVX512 inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

MOSAIC_AVX512 void q4_avx512(const MatvecArgs& a) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint16_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m512 acc[kTokTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int b = 0; b < blocks; ++b) {
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + b * 16 + kPrefetch), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(rs[b]));
        const __m512 lo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4))), eight), d);
        const __m512 hi = _mm512_mul_ps(
            _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4))), eight), d);
        const int c = b * kQ4, len = std::min(kQ4, a.cols - c);
        const __mmask16 mlo = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
        const __mmask16 mhi = len >= 32 ? 0xFFFF : (len <= 16 ? 0 : static_cast<__mmask16>((1u << (len - 16)) - 1));
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c;
          acc[t] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(mlo, x), acc[t]);
          acc[t] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(mhi, x + 16), acc[t]);
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = reduce(acc[t]);
    }
  }
}

// E4M3 -> f16 bits: sign to bit 15, exponent and mantissa shifted left by 7. As an f16 that is the value
// times 2^-8 for normals and subnormals alike, so the 2^8 is folded into the tile scale.
MOSAIC_AVX512 inline __m512 e4m3x16(const uint8_t* p, __mmask16 m) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}

MOSAIC_AVX512 void fp8_avx512(const MatvecArgs& a) {
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    const uint64_t srow = static_cast<uint64_t>(r / kFp8) * scale_cols;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m512 total[kTokTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
        const int end = std::min(c0 + kFp8, a.cols);
        __m512 acc[kTokTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = c0; c < end; c += 16) {
          if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + c + kPrefetch), _MM_HINT_T0);
          const int len = std::min(16, end - c);
          const __mmask16 m = len == 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
          const __m512 w = e4m3x16(row + c, m);
          for (int t = 0; t < nt; ++t)
            acc[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c), acc[t]);
        }
        const __m512 s = _mm512_set1_ps(scale_at(a.scales, a.scale_dtype, srow + c0 / kFp8) * 256.f);
        for (int t = 0; t < nt; ++t) total[t] = _mm512_fmadd_ps(acc[t], s, total[t]);
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = reduce(total[t]);
    }
  }
}

// --- Q4 with int8 activations (AVX-512 VNNI) ----------------------------------------------------
// x is quantised once per call to int8 per 32-block (scale amax/127); one vpdpbusd multiplies 64 nibble
// codes (u8) by 64 activations (s8) into 16 int32 lanes, each the sum over 4 elements. The code offset
// of 8 is removed per lane with precomputed 8 * (sum of the 4 activations), and each lane is scaled by
// d (weight block) * sx (activation block). Activations lose about 0.4 % (int8); weights are exact.
#define MOSAIC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

struct QuantisedX {
  std::vector<int8_t> q;     // [n][pairs * 64]
  std::vector<int32_t> g8;   // [n][pairs * 16]: 8 * sum of each 4 consecutive q
  std::vector<float> sl;     // [n][pairs * 16]: activation scale of the block each lane belongs to
};

static void quantise_x(const MatvecArgs& a, int pairs, QuantisedX& out) {
  const size_t per_q = static_cast<size_t>(pairs) * 64, per_l = static_cast<size_t>(pairs) * 16;
  out.q.assign(per_q * a.n, 0);  // capacity is kept across calls: no allocation once warm
  out.g8.assign(per_l * a.n, 0);
  out.sl.assign(per_l * a.n, 0.f);
  for (int t = 0; t < a.n; ++t) {
    const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
    int8_t* q = out.q.data() + per_q * t;
    for (int b = 0; b * kQ4 < a.cols; ++b) {
      const int c0 = b * kQ4, len = std::min(kQ4, a.cols - c0);
      float amax = 0.f;
      for (int j = 0; j < len; ++j) amax = std::max(amax, std::fabs(x[c0 + j]));
      const float sx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int j = 0; j < len; ++j) q[c0 + j] = static_cast<int8_t>(std::nearbyint(x[c0 + j] * inv));
      for (int lane = 0; lane < 8; ++lane) {
        int32_t g = 0;
        for (int j = 0; j < 4; ++j) g += q[c0 + lane * 4 + j];
        // Lane order inside a block pair: the block's low nibbles (elements 0-15) then its high ones.
        out.g8[per_l * t + b * 8 + lane] = 8 * g;
        out.sl[per_l * t + b * 8 + lane] = sx;
      }
    }
  }
}

MOSAIC_VNNI void q4_vnni(const MatvecArgs& a) {
  thread_local QuantisedX qx;
  const int blocks = (a.cols + kQ4 - 1) / kQ4, pairs = (blocks + 1) / 2;
  quantise_x(a, pairs, qx);
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i pick01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint16_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t = 0; t < a.n; ++t) {
      const int8_t* q = qx.q.data() + static_cast<size_t>(t) * pairs * 64;
      const int32_t* g8 = qx.g8.data() + static_cast<size_t>(t) * pairs * 16;
      const float* sl = qx.sl.data() + static_cast<size_t>(t) * pairs * 16;
      __m512 acc = _mm512_setzero_ps();
      for (int p = 0; p < pairs; ++p) {
        if ((p & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + p * 32 + kPrefetch), _MM_HINT_T0);
        const bool two = 2 * p + 1 < blocks;  // an odd last block pairs with zeros, never read past the row
        const __m256i v = _mm256_maskz_loadu_epi8(two ? 0xFFFFFFFFu : 0xFFFFu, row + p * 32);
        const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo0 lo1 hi0 hi1]
        z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));             // [lo0 hi0 lo1 hi1]
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, _mm512_loadu_si512(q + p * 64));
        dot = _mm512_sub_epi32(dot, _mm512_loadu_si512(g8 + p * 16));
        const float d0 = _cvtsh_ss(rs[2 * p]), d1 = two ? _cvtsh_ss(rs[2 * p + 1]) : 0.f;
        const __m512 d = _mm512_permutexvar_ps(pick01, _mm512_castps128_ps512(_mm_setr_ps(d0, d1, 0.f, 0.f)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_loadu_ps(sl + p * 16)), acc);
      }
      a.y[static_cast<uint64_t>(t) * a.ldy + r] = reduce(acc);
    }
  }
}

}  // namespace

IsaKernels avx512_kernels() { return {q4_avx512, fp8_avx512}; }
IsaKernels avx512_vnni_kernels() { return {q4_vnni, fp8_avx512}; }

}  // namespace mosaic
