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

// The 8 x 8 matrix whose rows are r[0..7], transposed in place: r[j] lane i becomes r[i] lane j.
MOSAIC_AVX2 inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // rows 2i and 2i + 1 interleaved
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // then their quadwords: four rows' column k in each 128-bit half
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {  // the halves of rows 0-3 and 4-7 joined
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

}  // namespace mosaic::avx2
