// AVX-512 helpers shared by the kernels compiled for that ISA (internal to native/src).
#pragma once

#include <immintrin.h>

#define MOSAIC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace mosaic {

// 16 E4M3 bytes -> floats through f16: sign to bit 15, exponent and mantissa shifted left by 7. As an f16
// that is the value times 2^-8 for normals and subnormals alike, so callers fold 2^8 into their scale.
MOSAIC_AVX512 inline __m512 e4m3x16(const uint8_t* p, __mmask16 m) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}

// One 32-block of activations (len of them; the rest read as zero) as int8 steps of amax / 127, rounded to
// nearest even (MXCSR's default), in two vectors of 16 int32: elements 0..15 and 16..31, or with Evens the
// block's even elements and then its odd ones (MXFP4's nibble order). Returns amax. The int8 loops of
// kernels_avx512.cpp and kernels_amx.cpp quantise through this, so they round alike.
template <bool Evens>
MOSAIC_AVX512 inline float quantise_block(const float* x, int len, __m512i& v0, __m512i& v1) {
  const __mmask16 m0 = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
  const __mmask16 m1 = len >= 32 ? 0xFFFF : len > 16 ? static_cast<__mmask16>((1u << (len - 16)) - 1) : 0;
  const __m512 x0 = _mm512_maskz_loadu_ps(m0, x), x1 = _mm512_maskz_loadu_ps(m1, x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
  v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
  if constexpr (Evens) {
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    const __m512i e = _mm512_permutex2var_epi32(v0, evens, v1), o = _mm512_permutex2var_epi32(v0, odds, v1);
    v0 = e, v1 = o;
  }
  return amax;
}

}  // namespace mosaic
