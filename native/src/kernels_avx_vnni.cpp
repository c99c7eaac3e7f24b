// Q4 and MXFP4 against int8 activations with AVX-VNNI (Isa::AvxVnni: Intel client CPUs from Alder Lake,
// AMD from Zen 5, which have AVX2 and VNNI but no AVX-512): the loops of int8_avx2_loops.h with one vpdpbusd
// for each vpmaddubsw + vpmaddwd pair. Everything else runs the AVX2 kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mosaic/kernels.h"

#include "prefill_blocks.h"
#include "simd_avx2.h"

namespace mosaic {
namespace {

#define MOSAIC_INT8_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
MOSAIC_INT8_TARGET inline __m256i pair_dots(__m256i lo, __m256i ql, __m256i hi, __m256i qh) {
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, ql), hi, qh);
}
// A block's dot products for NT tokens, rows in lanes (int8_avx2_loops.h): a chain of eight vpdpbusd a token,
// six tokens' chains side by side (two chains a token for four tokens ran the same, 1.0-1.07x).
template <bool Mx>
constexpr int kLaneTokens = 6;

template <int NT, bool Mx>
MOSAIC_INT8_TARGET inline void block_dots(const int32_t* w, const int8_t* q, const int32_t* neg_zsum,
                                          __m256i (&sum)[NT]) {
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t) sum[t] = _mm256_set1_epi32(neg_zsum[t]);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {  // k: the dword group, 0-3 low nibbles, 4-7 high
    const __m256i wk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * k));
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      sum[t] = _mm256_dpbusd_avx_epi32(sum[t], wk, avx2::broadcast_dword(q + 32 * t + 4 * k));
  }
}
#include "int8_avx2_loops.h"

MOSAIC_INT8_TARGET void q4_avx_vnni(const MatvecArgs& a) { int8_matvec<Q4Codes, uint16_t>(a); }
MOSAIC_INT8_TARGET void mxfp4_avx_vnni(const MatvecArgs& a) { int8_matvec<Mxfp4Codes, uint8_t>(a); }
#undef MOSAIC_INT8_TARGET

}  // namespace

IsaKernels avx_vnni_kernels() { return {q4_avx_vnni, avx2_kernels().fp8, mxfp4_avx_vnni}; }

}  // namespace mosaic
