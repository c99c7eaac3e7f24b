// Decode attention over an int8 cache in integer arithmetic (AVX-512 VNNI): one task of attend().
//
// Widening each int8 code to a float costs two vector ops for 16 values, as much again as the multiply-adds
// they feed, and it kept the float loop compute-bound at a quarter of float32's bytes. Here the codes are
// widened once to int16 (one op for 32) and multiplied in pairs by vpdpwssd: 32 products an op, against
// 16 for an FMA.
// - Scores: the queries are int16 codes, a head's largest magnitude at 32767 (a rounding of 1.5e-5 of
//   that magnitude); key codes widened to int16. The sums are exact in int32, since |code| <= 128,
//   |q| <= 32767 and head_dim <= 512 keep them below 2^31.
// - Values: each tile's probabilities (times the value rows' scales) are int16 codes, the tile's largest
//   at 32767, one scale per head and tile. Two value rows' codes are interleaved byte by byte, so one
//   vpdpwssd adds p_j v_j + p_j+1 v_j+1 for 16 output elements; the int32 sums of a tile are then
//   scaled into the float outputs.
// The softmax itself (reference max, exp, sums) is the float one of attention_tile.h.
//
// The loop is bound by instructions issued, not by memory: head_dim (D) and the tile's row count are
// compile-time constants on the hot path, so row and head offsets are displacements, and the first head
// block prefetches each line it loads one tile ahead (no prefetch bookkeeping in the inner loops).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "attention_tile.h"

namespace mosaic {
namespace attention {
namespace {

#define MOSAIC_VNNI_ATTENTION __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// acc + the pairwise products of a and b (vpdpwssd). In asm because GCC 12 copies the accumulator to a
// fresh register and back around each intrinsic call in these loops, doubling their instructions.
MOSAIC_VNNI_ATTENTION inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

inline void prefetch(const int8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Integer scores of HB query heads (q, rows d apart) against 4 key rows: the HB x 4 lane-partial sums in
// a[h * kTile + j]. With `ahead`, the rows one tile on are prefetched as these are read.
template <int HB, int D>
MOSAIC_VNNI_ATTENTION inline void score_block(const int16_t* q, int d_runtime, const int8_t* const (&krow)[4],
                                              __m512i* a, bool ahead) {
  const int d = D ? D : d_runtime;
  __m512i acc[HB][4];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_si512();
  for (int i = 0; i < d; i += 32) {
    __m512i kk[4];
    for (int j = 0; j < 4; ++j)
      kk[j] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(krow[j] + i)));
    if (ahead && i % 64 == 0)
      for (int j = 0; j < 4; ++j) prefetch(krow[j] + kTile * d + i);
    for (int h = 0; h < HB; ++h) {
      const __m512i qh = _mm512_loadu_si512(q + h * d + i);
      for (int j = 0; j < 4; ++j) acc[h][j] = dpwssd(acc[h][j], qh, kk[j]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) a[h * kTile + j] = acc[h][j];
}

// o[h] += pscale[h] * sum_j p[h][j] v[j] for HB heads over S slices of 32 output elements from element
// i0, over the n value rows of a tile (N when known; p[h][j] = 0 for j >= n, so an odd last row pairs
// with a zero). With `ahead`, the rows one tile on are prefetched as these are read.
template <int HB, int S, int D, int N>
MOSAIC_VNNI_ATTENTION inline void value_block(float* o, int d_runtime, int i0, const int16_t (*p)[kTile],
                                              const float* pscale, const int8_t* vt, int n_runtime, bool ahead) {
  const int d = D ? D : d_runtime, n = N ? N : n_runtime;
  __m512i acc[HB][2 * S];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < 2 * S; ++s) acc[h][s] = _mm512_setzero_si512();
  for (int j = 0; j < n; j += 2) {
    const int8_t* v0 = vt + j * d + i0;
    const int8_t* v1 = N ? v0 + d : vt + std::min(j + 1, n - 1) * d + i0;
    if (ahead && i0 % 64 == 0) {
      prefetch(v0 + kTile * d);
      prefetch(v0 + (kTile + 1) * d);
    }
    __m512i pairs[2 * S];  // 16 (v_j, v_j+1) int16 pairs each, in i8_order
    for (int s = 0; s < S; ++s) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 32 * s));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 32 * s));
      pairs[2 * s] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(x, y));
      pairs[2 * s + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(x, y));
    }
    for (int h = 0; h < HB; ++h) {
      int32_t pp;  // (p_j, p_j+1), the low half first
      std::memcpy(&pp, p[h] + j, 4);
      const __m512i ph = _mm512_set1_epi32(pp);
      for (int s = 0; s < 2 * S; ++s) acc[h][s] = dpwssd(acc[h][s], pairs[s], ph);
    }
  }
  for (int h = 0; h < HB; ++h) {
    const __m512 ps = _mm512_set1_ps(pscale[h]);
    for (int s = 0; s < 2 * S; ++s) {
      float* dst = o + h * d + i0 + 16 * s;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][s]), ps, _mm512_loadu_ps(dst)));
    }
  }
}

// The value phase of one head block: every slice of its output rows. Blocks of 8 heads take one slice
// of 32 at a time (16 accumulators), smaller ones two.
template <int HB, int D, int N>
MOSAIC_VNNI_ATTENTION inline void value_rows(float* o, int d_runtime, const int16_t (*p)[kTile],
                                             const float* pscale, const int8_t* vt, int n, bool ahead) {
  const int d = D ? D : d_runtime;
  int i = 0;
  if constexpr (HB <= 4)
    for (; i + 64 <= d; i += 64) value_block<HB, 2, D, N>(o, d, i, p, pscale, vt, n, ahead);
  for (; i < d; i += 32) value_block<HB, 1, D, N>(o, d, i, p, pscale, vt, n, ahead);
}

template <int D, int N>
MOSAIC_VNNI_ATTENTION inline void values(float* o, int rep, int d, const int16_t (*p)[kTile], const float* pscale,
                                         const int8_t* vt, int n) {
  int r0 = 0;
  for (; r0 + 8 <= rep; r0 += 8) value_rows<8, D, N>(o + r0 * d, d, p + r0, pscale + r0, vt, n, r0 == 0);
  for (; r0 < rep; r0 += 4) {
    const int hb = std::min(4, rep - r0);
    float* ob = o + r0 * d;
    if (hb == 4) value_rows<4, D, N>(ob, d, p + r0, pscale + r0, vt, n, r0 == 0);
    else if (hb == 3) value_rows<3, D, N>(ob, d, p + r0, pscale + r0, vt, n, r0 == 0);
    else if (hb == 2) value_rows<2, D, N>(ob, d, p + r0, pscale + r0, vt, n, r0 == 0);
    else value_rows<1, D, N>(ob, d, p + r0, pscale + r0, vt, n, r0 == 0);
  }
}

// probs (floats, each at most e^kSlack) as int16 codes: the largest at 32767, and its scale.
MOSAIC_VNNI_ATTENTION inline void quantize_probs(const float* probs, int16_t* codes, float* scale) {
  const __m512 w = _mm512_load_ps(probs);
  const float m = _mm512_reduce_max_ps(w);
  *scale = m / 32767.f;
  const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes),
                      _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w, inv))));
}

template <int D>
MOSAIC_VNNI_ATTENTION void task(const int16_t* q16, const float* qscale, int rep, int d_runtime, const int8_t* k,
                                const int8_t* v, RowScales rs, int k0, int k1, float* o, Partial* part) {
  // Tile-major as in attention.cpp's float task: a tile's key rows stay in L1 while every head scores
  // them, then its value rows while every head accumulates them.
  const int d = D ? D : d_runtime;
  alignas(64) float probs[kMaxRep][kTile];
  alignas(64) int16_t pcodes[kMaxRep][kTile];
  float pscale[kMaxRep];
  constexpr int kGroup = 8;  // heads scored before their softmax
  alignas(64) __m512i a[kGroup * kTile];  // the group's lane-partial scores
  SoftmaxState sm;
  sm.start(o, rep, d);
  for (int j0 = k0; j0 < k1; j0 += kTile) {
    const int n = std::min(kTile, k1 - j0);
    const __mmask16 live = tile_mask(n);
    const int8_t* kt = k + static_cast<int64_t>(j0) * d;
    const int8_t* vt = v + static_cast<int64_t>(j0) * d;
    const __m512 kscale = _mm512_maskz_loadu_ps(live, rs.k + j0);
    const __m512 vscale = _mm512_maskz_loadu_ps(live, rs.v + j0);
    for (int g0 = 0; g0 < rep; g0 += kGroup) {  // scores of a group of heads, in blocks of 4
      const int gn = std::min(kGroup, rep - g0);
      for (int r0 = g0; r0 < g0 + gn; r0 += 4) {
        const int hb = std::min(4, g0 + gn - r0);
        const int16_t* qb = q16 + static_cast<int64_t>(r0) * d;
        __m512i* ab = a + (r0 - g0) * kTile;
        for (int j = 0; j < kTile; j += 4) {
          if (j >= n) {
            for (int h = 0; h < hb; ++h)
              for (int jj = 0; jj < 4; ++jj) ab[h * kTile + j + jj] = _mm512_setzero_si512();
            continue;
          }
          const int8_t* const krow[4] = {  // rows past the tile's end repeat its last row, masked out below
              kt + std::min(j, n - 1) * d, kt + std::min(j + 1, n - 1) * d, kt + std::min(j + 2, n - 1) * d,
              kt + std::min(j + 3, n - 1) * d};
          const bool ahead = r0 == 0;
          if (hb == 4) score_block<4, D>(qb, d, krow, ab + j, ahead);
          else if (hb == 3) score_block<3, D>(qb, d, krow, ab + j, ahead);
          else if (hb == 2) score_block<2, D>(qb, d, krow, ab + j, ahead);
          else score_block<1, D>(qb, d, krow, ab + j, ahead);
        }
      }
      // The group's softmax in one pass, so its heads' dependency chains overlap.
      __m512 sc[kGroup];
      for (int h = 0; h < gn; ++h) {
        const __m512 dot = _mm512_cvtepi32_ps(sum16x16(a + h * kTile));
        sc[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live,
                                   _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(qscale[g0 + h])), kscale));
      }
      softmax_tile(sc, gn, sm.ref + g0, sm.sums + g0, o + static_cast<int64_t>(g0) * d, d, vscale, probs + g0);
      for (int h = 0; h < gn; ++h) quantize_probs(probs[g0 + h], pcodes[g0 + h], pscale + g0 + h);
    }
    if (n == kTile) values<D, kTile>(o, rep, d, pcodes, pscale, vt, n);
    else values<D, 0>(o, rep, d, pcodes, pscale, vt, n);
  }
  sm.finish(part, rep);
}

}  // namespace

MOSAIC_VNNI_ATTENTION void task_i8_vnni(const int16_t* q16, const float* qscale, int rep, int d, const int8_t* k,
                                        const int8_t* v, RowScales rs, int k0, int k1, float* o, Partial* part) {
  if (d == 128) task<128>(q16, qscale, rep, d, k, v, rs, k0, k1, o, part);
  else if (d == 256) task<256>(q16, qscale, rep, d, k, v, rs, k0, k1, o, part);
  else task<0>(q16, qscale, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace attention
}  // namespace mosaic
