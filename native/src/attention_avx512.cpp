// The AVX-512 task of decode attention (attention_task.h): tiles of 16 keys scored for blocks of up to 4
// query heads, each loaded key or value slice feeding every head of the block, with an online softmax
// (attention_tile.h) and the next tile prefetched from inside the arithmetic.
#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "attention_tile.h"

namespace mosaic {
namespace attention {
namespace {

// Slices 2i and 2i+1 (16 floats each) of a cached row, in the kernel's order.
// float32: the row's values 32i..32i+15 and 32i+16..32i+31, in place.
// bf16: one 64-byte load of 32 values. A bf16 is a float's top half, so the even-indexed values are the
// 32-bit lanes shifted left by 16 and the odd-indexed ones the lanes with their low half cleared: one
// integer op a slice, no shuffle and no widened copy. Inside each block of 32 the kernel's order is then
// evens, odds; attend lays the queries out the same way and puts the outputs back.
MOSAIC_AVX512 inline void load_pair(const float* row, int i, __m512& s0, __m512& s1) {
  s0 = _mm512_loadu_ps(row + 32 * i);
  s1 = _mm512_loadu_ps(row + 32 * i + 16);
}
MOSAIC_AVX512 inline void load_pair(const int8_t* row, int i, __m512& s0, __m512& s1) {  // codes, in place
  s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * i))));
  s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * i + 16))));
}
MOSAIC_AVX512 inline void load_pair(const uint16_t* row, int i, __m512& s0, __m512& s1) {
  const __m512i w = _mm512_loadu_si512(row + 32 * i);
  s0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  s1 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Scores of HB query heads (q, rows d apart, in the kernel's order) against 4 key rows, over the nv
// slices of a row: each loaded key slice feeds HB heads and each query slice 4 keys, so a multiply-add
// costs 1/HB + 1/4 loads from L1 instead of 1 or 2. L1 loads, not the FMA units, bound these loops (about
// one 64-byte load a cycle measured here). Leaves the HB x 4 lane-partial sums in a[h * kTile + j].
template <int HB, typename T>
MOSAIC_AVX512 inline void score_block(const float* q, int d, int nv, const T* const* krow, __m512* a,
                                      Prefetcher& pf) {
  __m512 acc[HB][4];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int i = 0; i + 2 <= nv; i += 2) {
    __m512 k0[4], k1[4];
    for (int j = 0; j < 4; ++j) load_pair(krow[j], i / 2, k0[j], k1[j]);
    pf.step();
    for (int h = 0; h < HB; ++h) {
      const __m512 q0 = _mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * i);
      const __m512 q1 = _mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * i + 16);
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(q1, k1[j], _mm512_fmadd_ps(q0, k0[j], acc[h][j]));
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    if (nv % 2) {  // an odd last slice (head_dim 80, 112, ...); bf16 rows come in whole pairs
      for (int j = 0; j < 4; ++j) {
        const __m512 kv = _mm512_loadu_ps(krow[j] + 16 * (nv - 1));
        for (int h = 0; h < HB; ++h)
          acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * (nv - 1)), kv, acc[h][j]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) a[h * kTile + j] = acc[h][j];
}

// o[h] += sum_j p[h][j] v[j] for HB heads over S slices of their output rows from slice i0
// (even when S is), over the n value rows of a tile: each loaded value slice feeds HB heads.
template <int HB, int S, typename T>
MOSAIC_AVX512 inline void value_block(float* o, int d, int i0, const float (*p)[kTile], const T* vt, int n,
                                      Prefetcher& pf) {
  __m512 acc[HB][S];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s)
      acc[h][s] = _mm512_loadu_ps(o + static_cast<int64_t>(h) * d + 16 * (i0 + s));
  for (int j = 0; j < n; ++j) {
    const T* vr = vt + static_cast<int64_t>(j) * d;
    pf.step();
    __m512 vv[S];
    if constexpr (S == 1) vv[0] = _mm512_loadu_ps(vr + 16 * i0);  // float32 only
    else
      for (int s = 0; s < S; s += 2) load_pair(vr, (i0 + s) / 2, vv[s], vv[s + 1]);
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h][j]);
      for (int s = 0; s < S; ++s) acc[h][s] = _mm512_fmadd_ps(ph, vv[s], acc[h][s]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(o + static_cast<int64_t>(h) * d + 16 * (i0 + s), acc[h][s]);
}

// The value phase of one head block (HB heads): every slice of their output rows, 4 at a time.
template <int HB, typename T>
MOSAIC_AVX512 inline void value_rows(float* o, int d, int nv, const float (*p)[kTile], const T* vt, int n,
                                     Prefetcher& pf) {
  int i = 0;
  for (; i + 4 <= nv; i += 4) value_block<HB, 4, T>(o, d, i, p, vt, n, pf);
  for (; i + 2 <= nv; i += 2) value_block<HB, 2, T>(o, d, i, p, vt, n, pf);
  if constexpr (std::is_same<T, float>::value)
    if (i < nv) value_block<HB, 1, T>(o, d, i, p, vt, n, pf);
}

// One task, AVX-512, head_dim a multiple of 16 (of 32 for bf16 and int8): rep (at most kMaxRep) query
// heads (q, rep x d, in the kernel's order) over keys [k0, k1) of one KV head. Leaves unnormalised outputs
// in o (rep x d, the kernel's order) and max/sum in part. NV = d / 16 when known at compile time, else 0.
template <int NV, typename T>
MOSAIC_AVX512 void task(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1,
                               float* o, Partial* part) {
  // Tile-major: a tile's 16 key rows come from memory once and stay in L1 while every query head of the
  // group scores them; then its 16 value rows, while every head accumulates them. Heads go in blocks of
  // 4 (the last block 1-3), so each row slice loaded from L1 feeds several heads.
  const int nv = NV ? NV : d / 16;
  // The next tiles' lines are prefetched spread over this tile's inner iterations (Prefetcher).
  const int tile_lines = kTile * d * static_cast<int>(sizeof(T)) / 64;
  const int blocks = (rep + 3) / 4;
  const int steps = blocks * (kTile / 4) * (nv / 2) + blocks * ((nv + 3) / 4) * kTile;  // a full tile's
  const int per_step = (2 * tile_lines + steps - 1) / steps;
  const int64_t ahead = static_cast<int64_t>(kTile) * d;  // elements: the next tile (16 KB of float32 at head_dim 256)
  alignas(64) float probs[kMaxRep][kTile];
  alignas(64) __m512 a[4 * kTile];  // one head block's lane-partial scores
  SoftmaxState sm;
  sm.start(o, rep, d);
  for (int j0 = k0; j0 < k1; j0 += kTile) {
    const int n = std::min(kTile, k1 - j0);
    const __mmask16 live = tile_mask(n);
    const T* kt = k + static_cast<int64_t>(j0) * d;
    const T* vt = v + static_cast<int64_t>(j0) * d;
    Prefetcher pf{reinterpret_cast<const char*>(kt + ahead), reinterpret_cast<const char*>(vt + ahead), tile_lines,
                  per_step};
    for (int r0 = 0; r0 < rep; r0 += 4) {  // scores, one head block at a time
      const int hb = std::min(4, rep - r0);
      const float* qb = q + static_cast<int64_t>(r0) * d;  // already times scale
      for (int j = 0; j < kTile; j += 4) {
        if (j >= n) {
          for (int h = 0; h < hb; ++h)
            for (int jj = 0; jj < 4; ++jj) a[h * kTile + j + jj] = _mm512_setzero_ps();
          continue;
        }
        // rows past the tile's end repeat its last row: read in bounds, masked out of the softmax below
        const T* krow[4];
        for (int jj = 0; jj < 4; ++jj) krow[jj] = kt + static_cast<int64_t>(std::min(j + jj, n - 1)) * d;
        if (hb == 4) score_block<4, T>(qb, d, nv, krow, a + j, pf);
        else if (hb == 3) score_block<3, T>(qb, d, nv, krow, a + j, pf);
        else if (hb == 2) score_block<2, T>(qb, d, nv, krow, a + j, pf);
        else score_block<1, T>(qb, d, nv, krow, a + j, pf);
      }
      // An int8 key's dot product times its row's scale; a float key's scale is 1.
      const __m512 kscale = rs.k ? _mm512_maskz_loadu_ps(live, rs.k + j0) : _mm512_set1_ps(1.f);
      const __m512 vscale = rs.v ? _mm512_maskz_loadu_ps(live, rs.v + j0) : _mm512_set1_ps(1.f);
      __m512 sc[4];
      for (int h = 0; h < hb; ++h)
        sc[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live,
                                   _mm512_mul_ps(sum16x16(a + h * kTile), kscale));
      softmax_tile(sc, hb, sm.ref + r0, sm.sums + r0, o + static_cast<int64_t>(r0) * d, d, vscale, probs + r0);
    }
    for (int r0 = 0; r0 < rep; r0 += 4) {  // values, one head block at a time
      const int hb = std::min(4, rep - r0);
      float* ob = o + static_cast<int64_t>(r0) * d;
      if (hb == 4) value_rows<4, T>(ob, d, nv, probs + r0, vt, n, pf);
      else if (hb == 3) value_rows<3, T>(ob, d, nv, probs + r0, vt, n, pf);
      else if (hb == 2) value_rows<2, T>(ob, d, nv, probs + r0, vt, n, pf);
      else value_rows<1, T>(ob, d, nv, probs + r0, vt, n, pf);
    }
  }
  sm.finish(part, rep);
}

template <typename T>
MOSAIC_AVX512 void task_for(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1,
                            float* o, Partial* part) {
  if (d == 64) task<4, T>(q, rep, d, k, v, rs, k0, k1, o, part);
  else if (d == 128) task<8, T>(q, rep, d, k, v, rs, k0, k1, o, part);
  else if (d == 256) task<16, T>(q, rep, d, k, v, rs, k0, k1, o, part);
  else task<0, T>(q, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace

void task_avx512(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part) {
  task_for(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx512(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part) {
  task_for(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_avx512(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part) {
  task_for(q, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace attention
}  // namespace mosaic
