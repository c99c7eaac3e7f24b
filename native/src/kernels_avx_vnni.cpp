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
MOSAIC_INT8_TARGET inline __m256i lane_dots(const int32_t* w, const int8_t* xl, const int8_t* xh) {
  auto codes = [&](int k) MOSAIC_INT8_TARGET {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * k));
  };
  // two chains of four, not one of eight: half the latency a block waits on (a few per cent at 16-32 tokens)
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    lo = _mm256_dpbusd_avx_epi32(lo, codes(k), avx2::broadcast_dword(xl + 4 * k));
    hi = _mm256_dpbusd_avx_epi32(hi, codes(4 + k), avx2::broadcast_dword(xh + 4 * k));
  }
  return _mm256_add_epi32(lo, hi);
}
#include "int8_avx2_loops.h"

MOSAIC_INT8_TARGET void q4_avx_vnni(const MatvecArgs& a) { int8_matvec<Q4Codes, uint16_t>(a); }
MOSAIC_INT8_TARGET void mxfp4_avx_vnni(const MatvecArgs& a) { int8_matvec<Mxfp4Codes, uint8_t>(a); }
#undef MOSAIC_INT8_TARGET

}  // namespace

IsaKernels avx_vnni_kernels() { return {q4_avx_vnni, avx2_kernels().fp8, mxfp4_avx_vnni}; }

}  // namespace mosaic
