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
  int32_t vl[4], vh[4];
  std::memcpy(vl, xl, sizeof(vl));
  std::memcpy(vh, xh, sizeof(vh));
  auto codes = [&](int k) MOSAIC_INT8_TARGET {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 * k));
  };
  __m256i sum = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    sum = _mm256_dpbusd_avx_epi32(sum, codes(k), _mm256_set1_epi32(vl[k]));
    sum = _mm256_dpbusd_avx_epi32(sum, codes(4 + k), _mm256_set1_epi32(vh[k]));
  }
  return sum;
}
#include "int8_avx2_loops.h"

MOSAIC_INT8_TARGET void q4_avx_vnni(const MatvecArgs& a) { int8_matvec<Q4Codes, uint16_t>(a); }
MOSAIC_INT8_TARGET void mxfp4_avx_vnni(const MatvecArgs& a) { int8_matvec<Mxfp4Codes, uint8_t>(a); }
#undef MOSAIC_INT8_TARGET

}  // namespace

IsaKernels avx_vnni_kernels() { return {q4_avx_vnni, avx2_kernels().fp8, mxfp4_avx_vnni}; }

}  // namespace mosaic
