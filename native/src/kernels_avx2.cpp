// AVX2 kernels: the AVX-512 ones at half width; partial blocks and tails go through the scalar
// arithmetic of the reference.
#include <immintrin.h>

#include <algorithm>

#include "mosaic/kernels.h"

#define MOSAIC_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace mosaic {
namespace {

constexpr int kTokTile = 4;
constexpr int kPrefetch = 4096;

MOSAIC_AVX2 inline float reduce(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

MOSAIC_AVX2 inline __m256 widen8(__m128i bytes, __m256 d) {  // 8 nibble codes -> d * (q - 8)
  return _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(8.f)), d);
}

MOSAIC_AVX2 void q4_avx2(const MatvecArgs& a) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  const int whole = a.cols / kQ4;
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint16_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m256 acc[kTokTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int b = 0; b < whole; ++b) {
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + b * 16 + kPrefetch), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(rs[b]));
        const __m256 w0 = widen8(lo, d), w1 = widen8(_mm_srli_si128(lo, 8), d);
        const __m256 w2 = widen8(hi, d), w3 = widen8(_mm_srli_si128(hi, 8), d);
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + b * kQ4;
          acc[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[t]);
          acc[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[t]);
          acc[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), acc[t]);
          acc[t] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), acc[t]);
        }
      }
      for (int t = 0; t < nt; ++t) {
        float s = reduce(acc[t]);
        if (whole < blocks) {  // the partial last block
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + whole * kQ4;
          const uint8_t* p = row + whole * 16;
          const float d = f16_to_f32(rs[whole]);
          float part = 0.f;
          for (int j = 0; j < a.cols - whole * kQ4; ++j)
            part += (static_cast<float>(j < 16 ? (p[j] & 0xF) : (p[j - 16] >> 4)) - 8.f) * x[j];
          s += d * part;
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

}  // namespace

IsaKernels avx2_kernels() { return {q4_avx2, fp8_avx2}; }

}  // namespace mosaic
