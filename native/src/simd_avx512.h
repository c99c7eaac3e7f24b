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

}  // namespace mosaic
