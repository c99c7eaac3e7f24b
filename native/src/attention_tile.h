// Pieces shared by the AVX-512 decode-attention tasks (attention_avx512.cpp, attention_i8.cpp): the online
// softmax over one tile of 16 keys, its exp and the 16-way lane reductions. Internal to native/src.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_task.h"
#include "simd_avx512.h"

namespace mosaic {
namespace attention {

// exp(x) for x <= kSlack (scores minus their reference max), attention_task.h's polynomial, scaled by 2^n.
MOSAIC_AVX512 inline __m512 exp_scores(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpTerms[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTerms[i]));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// S[j] = the sum of acc[j]'s 16 lanes, for 16 accumulators at once: pairwise adds through unpacks and
// 128-bit block shuffles, 45 operations instead of 16 separate reductions (128).
MOSAIC_AVX512 inline __m512 sum16x16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit block: [a2j partial, a2j+1 partial] x 2
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per block: [a4j, a4j+1, a4j+2, a4j+3] partials
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same for int32 lanes, exactly (the integer scores of attention_i8.cpp).
MOSAIC_AVX512 inline __m512i sum16x16(const __m512i* a) {
  __m512i b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * j], a[2 * j + 1]),
                            _mm512_unpackhi_epi32(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j)
    c[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * j], b[2 * j + 1]),
                            _mm512_unpackhi_epi64(b[2 * j], b[2 * j + 1]));
  for (int j = 0; j < 2; ++j)
    d[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The first n of a tile's 16 lanes.
inline __mmask16 tile_mask(int n) { return n >= kTile ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// A task's online-softmax state for its rep query heads: each one's reference max (exp's offset) and the
// lanes of its running sum of probabilities, relative to e^ref.
struct SoftmaxState {
  float ref[kMaxRep];
  __m512 sums[kMaxRep];
  // Before the first tile: no reference yet, nothing summed, the outputs o (rep x d) zero.
  MOSAIC_AVX512 void start(float* o, int rep, int d) {
    for (int r = 0; r < rep; ++r) {
      std::fill(o + static_cast<int64_t>(r) * d, o + static_cast<int64_t>(r + 1) * d, 0.f);
      ref[r] = -std::numeric_limits<float>::infinity();
      sums[r] = _mm512_setzero_ps();
    }
  }
  MOSAIC_AVX512 void finish(Partial* part, int rep) const {
    for (int r = 0; r < rep; ++r) part[r] = {ref[r], _mm512_reduce_add_ps(sums[r])};
  }
};

// The online softmax of hb query heads over one tile: sc[h] are head h's scores (masked keys -inf).
// ref, sums, o (hb rows of d floats) and probs belong to the block's first head. The block's heads go
// step by step (the rare new reference, then exp), so their dependency chains overlap instead of running
// one head after another. Leaves probs[h] = p * vscale: the value rows' scales ride on the probabilities
// (p v_j s_j), not on the sums.
MOSAIC_AVX512 inline void softmax_tile(const __m512* sc, int hb, float* ref, __m512* sums, float* o, int d,
                                       __m512 vscale, float (*probs)[kTile]) {
  for (int h = 0; h < hb; ++h) {
    if (_mm512_cmp_ps_mask(sc[h], _mm512_set1_ps(ref[h] + kSlack), _CMP_GT_OQ)) {
      // A new reference: the exact max so far. What was summed under the old one is scaled to the new
      // (by 0 on the first tile, whose reference is -inf, where the outputs and sums are still 0).
      const float m_new = std::max(ref[h], _mm512_reduce_max_ps(sc[h]));
      const __m512 c = exp_scores(_mm512_set1_ps(ref[h] - m_new));
      float* orow = o + static_cast<int64_t>(h) * d;
      for (int i = 0; i < d; i += 16) _mm512_storeu_ps(orow + i, _mm512_mul_ps(_mm512_loadu_ps(orow + i), c));
      sums[h] = _mm512_mul_ps(sums[h], c);
      ref[h] = m_new;
    }
  }
  for (int h = 0; h < hb; ++h) {
    const __m512 p = exp_scores(_mm512_sub_ps(sc[h], _mm512_set1_ps(ref[h])));
    sums[h] = _mm512_add_ps(sums[h], p);
    _mm512_store_ps(probs[h], _mm512_mul_ps(p, vscale));
  }
}

}  // namespace attention
}  // namespace mosaic
