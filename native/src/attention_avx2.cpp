// The AVX2 task of decode attention (attention_task.h), head_dim a multiple of 8, elements in place: the
// AVX-512 task's plan (attention_avx512.cpp) at eight lanes. Tiles of 8 keys, each tile's key rows read
// from memory once while every query head of the group scores them, then its value rows while every head
// accumulates them, with an online softmax over the tile's eight scores in one vector. Each loaded key or
// value slice feeds a block of heads, and each query slice several keys, so the loops are bound by the FMA
// units rather than by loads and horizontal sums.
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "attention_task.h"
#include "simd_avx2.h"

namespace mosaic {
namespace attention {
namespace {

constexpr int kTile8 = 8;  // keys a tile: one vector of scores

MOSAIC_AVX2 inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
MOSAIC_AVX2 inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
MOSAIC_AVX2 inline __m256 widen8(const int8_t* p) {  // codes; their row's scale rides on the score or probability
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for x <= kSlack, attention_task.h's polynomial at eight lanes, times 2^n built in the exponent field
// (n >= -126 here, a normal float).
MOSAIC_AVX2 inline __m256 exp8(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpTerms[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTerms[i]));
  const __m256 two_n =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, two_n));
}

MOSAIC_AVX2 inline float max8(__m256 v) {
  const __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// Lane j = the sum of a[j]'s eight lanes, for eight accumulators at once (a tile's keys): two rounds of
// vhaddps leave each 128-bit half's sums, and one add of the halves finishes them.
MOSAIC_AVX2 inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0-3 low, a0-3 high], [a4-7 ...]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane-partial scores of HB query heads (q, rows d apart, already times scale) against KB key rows over
// the whole row: each widened key slice feeds HB heads, each query slice KB keys. HB * KB <= 8 keeps the
// accumulators, a query slice and the key slices in the 16 registers. a[h * kTile8 + j] gets head h, key j.
template <int HB, int KB, typename T>
MOSAIC_AVX2 inline void score_block(const float* q, int d, const T* const* krow, __m256* a, Prefetcher& pf) {
  __m256 acc[HB][KB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < KB; ++j) acc[h][j] = _mm256_setzero_ps();
  for (int i = 0; i < d; i += 8) {
    __m256 kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = widen8(krow[j] + i);
    pf.step();
    for (int h = 0; h < HB; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + static_cast<int64_t>(h) * d + i);
      for (int j = 0; j < KB; ++j) acc[h][j] = _mm256_fmadd_ps(qv, kv[j], acc[h][j]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < KB; ++j) a[h * kTile8 + j] = acc[h][j];
}

// The scores of a head block of HB over one tile of n keys (kt: its first row): KB keys at a time, rows
// past the tile's end repeating its last row (read in bounds, masked out of the softmax by the caller).
// Keys a score_block takes for a head block of hb: hb times that many accumulators, at most 8.
constexpr int key_block(int hb) { return hb == 1 ? 8 : hb == 2 ? 4 : 2; }

template <int HB, typename T>
MOSAIC_AVX2 inline void score_tile(const float* q, int d, const T* kt, int n, __m256* a, Prefetcher& pf) {
  constexpr int KB = key_block(HB);
  for (int j = 0; j < kTile8; j += KB) {
    const T* krow[KB];
    for (int jj = 0; jj < KB; ++jj) krow[jj] = kt + static_cast<int64_t>(std::min(j + jj, n - 1)) * d;
    score_block<HB, KB, T>(q, d, krow, a + j, pf);
  }
}

// o[h] += sum_j p[h][j] v[j] for HB heads over S slices (8 floats each) of their output rows from element
// i0, over the n value rows of a tile: each widened value slice feeds HB heads.
template <int HB, int S, typename T>
MOSAIC_AVX2 inline void value_block(float* o, int d, int i0, const float (*p)[kTile8], const T* vt, int n,
                                    Prefetcher& pf) {
  __m256 acc[HB][S];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s) acc[h][s] = _mm256_loadu_ps(o + static_cast<int64_t>(h) * d + i0 + 8 * s);
  for (int j = 0; j < n; ++j) {
    const T* vr = vt + static_cast<int64_t>(j) * d + i0;
    pf.step();
    __m256 vv[S];
    for (int s = 0; s < S; ++s) vv[s] = widen8(vr + 8 * s);
    for (int h = 0; h < HB; ++h) {
      const __m256 ph = _mm256_broadcast_ss(&p[h][j]);
      for (int s = 0; s < S; ++s) acc[h][s] = _mm256_fmadd_ps(ph, vv[s], acc[h][s]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s) _mm256_storeu_ps(o + static_cast<int64_t>(h) * d + i0 + 8 * s, acc[h][s]);
}

template <int HB, typename T>
MOSAIC_AVX2 inline void value_rows(float* o, int d, const float (*p)[kTile8], const T* vt, int n, Prefetcher& pf) {
  int i = 0;
  for (; i + 16 <= d; i += 16) value_block<HB, 2, T>(o, d, i, p, vt, n, pf);
  if (i < d) value_block<HB, 1, T>(o, d, i, p, vt, n, pf);
}

// f(std::integral_constant<int, hb>{}) for a head block of hb in 1..4.
template <typename F>
MOSAIC_AVX2 inline void with_block(int hb, F&& f) {
  if (hb == 4) f(std::integral_constant<int, 4>{});
  else if (hb == 3) f(std::integral_constant<int, 3>{});
  else if (hb == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

template <typename T>
MOSAIC_AVX2 void task(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1, float* o,
                      Partial* part) {
  alignas(32) float probs[kMaxRep][kTile8];
  alignas(32) __m256 a[4 * kTile8];  // one head block's lane-partial scores
  float ref[kMaxRep];
  __m256 sums[kMaxRep];
  for (int r = 0; r < rep; ++r) {
    std::fill(o + static_cast<int64_t>(r) * d, o + static_cast<int64_t>(r + 1) * d, 0.f);
    ref[r] = -std::numeric_limits<float>::infinity();
    sums[r] = _mm256_setzero_ps();
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // The next tile's lines are prefetched spread over this tile's inner iterations (Prefetcher).
  const int tile_lines = kTile8 * d * static_cast<int>(sizeof(T)) / 64;
  int steps = 0;
  for (int r0 = 0; r0 < rep; r0 += 4) {
    const int hb = std::min(4, rep - r0);
    steps += kTile8 / key_block(hb) * (d / 8) + (d + 15) / 16 * kTile8;  // score_block's slices, value_block's rows
  }
  const int per_step = (2 * tile_lines + steps - 1) / steps;
  for (int j0 = k0; j0 < k1; j0 += kTile8) {
    const int n = std::min(kTile8, k1 - j0);
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    const T* kt = k + static_cast<int64_t>(j0) * d;
    const T* vt = v + static_cast<int64_t>(j0) * d;
    Prefetcher pf{reinterpret_cast<const char*>(kt + kTile8 * d), reinterpret_cast<const char*>(vt + kTile8 * d),
                  tile_lines, per_step};
    // An int8 key's dot product times its row's scale, its value's scale on the probability; else 1.
    const __m256 kscale = rs.k ? _mm256_maskload_ps(rs.k + j0, _mm256_castps_si256(live)) : _mm256_set1_ps(1.f);
    const __m256 vscale = rs.v ? _mm256_maskload_ps(rs.v + j0, _mm256_castps_si256(live)) : _mm256_set1_ps(1.f);
    for (int r0 = 0; r0 < rep; r0 += 4) {  // scores and their softmax, one head block at a time
      const int hb = std::min(4, rep - r0);
      with_block(hb, [&](auto block) MOSAIC_AVX2 {
        score_tile<decltype(block)::value, T>(q + static_cast<int64_t>(r0) * d, d, kt, n, a, pf);
      });
      for (int h = r0; h < r0 + hb; ++h) {
        const __m256 sc = _mm256_blendv_ps(minus_inf, _mm256_mul_ps(sum8x8(a + (h - r0) * kTile8), kscale), live);
        if (_mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(ref[h] + kSlack), _CMP_GT_OQ))) {
          // A new reference: the exact max so far; what was summed under the old one is scaled to it (by 0
          // on the first tile, whose reference is -inf, where the outputs and sums are still 0).
          const float m_new = std::max(ref[h], max8(sc));
          const __m256 c = exp8(_mm256_set1_ps(ref[h] - m_new));
          float* orow = o + static_cast<int64_t>(h) * d;
          for (int i = 0; i < d; i += 8) _mm256_storeu_ps(orow + i, _mm256_mul_ps(_mm256_loadu_ps(orow + i), c));
          sums[h] = _mm256_mul_ps(sums[h], c);
          ref[h] = m_new;
        }
        const __m256 p = exp8(_mm256_sub_ps(sc, _mm256_set1_ps(ref[h])));
        sums[h] = _mm256_add_ps(sums[h], p);
        _mm256_store_ps(probs[h], _mm256_mul_ps(p, vscale));
      }
    }
    for (int r0 = 0; r0 < rep; r0 += 4)  // values, one head block at a time
      with_block(std::min(4, rep - r0), [&](auto block) MOSAIC_AVX2 {
        value_rows<decltype(block)::value, T>(o + static_cast<int64_t>(r0) * d, d, probs + r0, vt, n, pf);
      });
  }
  for (int r = 0; r < rep; ++r) part[r] = {ref[r], avx2::reduce(sums[r])};
}

}  // namespace

void task_avx2(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx2(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx2(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace attention
}  // namespace mosaic
