// CRC-32 by carry-less-multiply folding (PCLMULQDQ; Intel's "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ", the constants of Linux's crc32-pclmul and Chromium's zlib): crc32.cpp's bulk on x86-64.
#include <immintrin.h>

#include "crc32_accelerated.h"

namespace mosaic::detail {
namespace {

#define MOSAIC_PCLMUL __attribute__((target("pclmul,sse4.1")))

MOSAIC_PCLMUL inline __m128i load(const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }

// acc * x^(128 or 512) folded onto the next 16 bytes, k holding the two folding constants.
MOSAIC_PCLMUL inline __m128i fold(__m128i acc, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x11), _mm_clmulepi64_si128(acc, k, 0x00)), next);
}

// Folds 64 bytes per step with four 128-bit accumulators, then reduces to 32 bits (Barrett).
// n >= 64 and a multiple of 16; c is the running (inverted) state.
MOSAIC_PCLMUL uint32_t crc32_pclmul(uint32_t c, const uint8_t* p, size_t n) {
  alignas(16) static const uint64_t k1k2[2] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[2] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5k0[2] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const uint64_t poly[2] = {0x01db710641, 0x01f7011641};
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x1 = fold(x1, k, load(p));
    x2 = fold(x2, k, load(p + 16));
    x3 = fold(x3, k, load(p + 32));
    x4 = fold(x4, k, load(p + 48));
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = fold(x1, k, x2);
  x1 = fold(x1, k, x3);
  x1 = fold(x1, k, x4);
  for (; n >= 16; p += 16, n -= 16) x1 = fold(x1, k, load(p));
  // 128 -> 64 bits.
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  x2 = _mm_clmulepi64_si128(x1, k, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x00), x2);
  // Barrett reduction to 32 bits.
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x10), mask32);
  x2 = _mm_clmulepi64_si128(x2, k, 0x00);
  x1 = _mm_xor_si128(x1, x2);
  return static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

bool has_pclmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

const bool kPclmul = has_pclmul();
}  // namespace

size_t crc32_accelerated(uint32_t& c, const uint8_t* p, size_t n) {
  if (!kPclmul || n < 64) return 0;
  const size_t bulk = n & ~static_cast<size_t>(15);
  c = crc32_pclmul(c, p, bulk);
  return bulk;
}

}  // namespace mosaic::detail
