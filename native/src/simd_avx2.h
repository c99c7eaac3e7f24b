// The target of the functions compiled for AVX2, and the helpers they share (internal to native/src).
#pragma once

#include <immintrin.h>

#define MOSAIC_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace mosaic::avx2 {

MOSAIC_AVX2 inline float reduce(__m256 v) {  // the sum of v's eight lanes
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// The four bytes at p in every dword, as one load (vpbroadcastd m32). Not vbroadcastss: on AMD Zen 4 that
// float-domain load feeding vpmaddubsw ran the AVX2 lane loop at 0.8x. Nor a dword copied out with memcpy
// and broadcast from a register: that went through a general register and two shuffle-port moves, which
// starved vpdpbusd of its port.
MOSAIC_AVX2 inline __m256i broadcast_dword(const void* p) {
  return _mm256_broadcastd_epi32(_mm_loadu_si32(p));
}

}  // namespace mosaic::avx2
