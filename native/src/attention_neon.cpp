// The NEON task of decode attention (attention_task.h), head_dim a multiple of 8, elements in place: the AVX2
// task's plan (attention_avx2.cpp) at four lanes. Tiles of 8 keys, each tile's key rows read from memory once
// while every query head of the group scores them, then its value rows while every head accumulates them,
// with an online softmax over the tile's scores (two vectors of four). Each widened key or value slice feeds a
// block of up to 4 heads, and each query slice several keys, in NEON's 32 registers.
#include <arm_neon.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "attention_task.h"
#include "simd_neon.h"

namespace mosaic {
namespace attention {
namespace {

constexpr int kTile8 = 8;  // keys a tile: two vectors of scores

inline void widen8(const float* p, float32x4_t& lo, float32x4_t& hi) {
  lo = vld1q_f32(p);
  hi = vld1q_f32(p + 4);
}
inline void widen8(const uint16_t* p, float32x4_t& lo, float32x4_t& hi) { neon::widen_bf16(p, lo, hi); }
inline void widen8(const int8_t* p, float32x4_t& lo, float32x4_t& hi) { neon::widen_i8(vld1_s8(p), lo, hi); }

// exp(x) for x <= kSlack, attention_task.h's polynomial at four lanes, times 2^n built in the exponent field
// (n >= -126 here, a normal float).
inline float32x4_t exp4(float32x4_t x) {
  const uint32x4_t tiny = vcltq_f32(x, vdupq_n_f32(kExpFloor));
  x = vmaxq_f32(x, vdupq_n_f32(kExpFloor));
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, kLog2e));
  const float32x4_t r = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(kLn2Hi)), n, vdupq_n_f32(kLn2Lo));
  float32x4_t p = vdupq_n_f32(kExpTerms[0]);
  for (int i = 1; i < 7; ++i) p = vfmaq_f32(vdupq_n_f32(kExpTerms[i]), p, r);
  const float32x4_t two_n =
      vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p, two_n)), tiny));
}

// Lane j = the sum of a[j]'s four lanes, for four accumulators (four of a tile's keys).
inline float32x4_t sum4x4(const float32x4_t* a) {
  return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}

// Lane-partial scores of HB query heads (q, rows d apart, already times scale) against KB key rows over the
// whole row, 8 elements a step: each widened key slice feeds HB heads, each query slice KB keys.
// a[h * kTile8 + j] gets head h, key j.
template <int HB, int KB, typename T>
inline void score_block(const float* q, int d, const T* const* krow, float32x4_t* a, Prefetcher& pf) {
  float32x4_t acc[HB][KB];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < KB; ++j) acc[h][j] = vdupq_n_f32(0.f);
  for (int i = 0; i < d; i += 8) {
    float32x4_t lo[KB], hi[KB];
    for (int j = 0; j < KB; ++j) widen8(krow[j] + i, lo[j], hi[j]);
    pf.step();
    for (int h = 0; h < HB; ++h) {
      const float* qh = q + static_cast<int64_t>(h) * d + i;
      const float32x4_t q0 = vld1q_f32(qh), q1 = vld1q_f32(qh + 4);
      for (int j = 0; j < KB; ++j) acc[h][j] = vfmaq_f32(vfmaq_f32(acc[h][j], q0, lo[j]), q1, hi[j]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < KB; ++j) a[h * kTile8 + j] = acc[h][j];
}

// Keys a score_block takes for a head block of hb: up to 16 accumulators beside the key slices.
constexpr int key_block(int hb) { return hb == 1 ? 8 : 4; }

// The scores of a head block of HB over one tile of n keys (kt: its first row), rows past the tile's end
// repeating its last row (read in bounds, masked out of the softmax by the caller).
template <int HB, typename T>
inline void score_tile(const float* q, int d, const T* kt, int n, float32x4_t* a, Prefetcher& pf) {
  constexpr int KB = key_block(HB);
  for (int j = 0; j < kTile8; j += KB) {
    const T* krow[KB];
    for (int jj = 0; jj < KB; ++jj) krow[jj] = kt + static_cast<int64_t>(std::min(j + jj, n - 1)) * d;
    score_block<HB, KB, T>(q, d, krow, a + j, pf);
  }
}

// o[h] += sum_j p[h][j] v[j] for HB heads over S steps of 8 elements of their output rows from element i0,
// over the n value rows of a tile: each widened value slice feeds HB heads.
template <int HB, int S, typename T>
inline void value_block(float* o, int d, int i0, const float (*p)[kTile8], const T* vt, int n, Prefetcher& pf) {
  float32x4_t acc[HB][2 * S];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < 2 * S; ++s) acc[h][s] = vld1q_f32(o + static_cast<int64_t>(h) * d + i0 + 4 * s);
  for (int j = 0; j < n; ++j) {
    const T* vr = vt + static_cast<int64_t>(j) * d + i0;
    pf.step();
    float32x4_t vv[2 * S];
    for (int s = 0; s < S; ++s) widen8(vr + 8 * s, vv[2 * s], vv[2 * s + 1]);
    for (int h = 0; h < HB; ++h) {
      const float ph = p[h][j];
      for (int s = 0; s < 2 * S; ++s) acc[h][s] = vfmaq_n_f32(acc[h][s], vv[s], ph);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < 2 * S; ++s) vst1q_f32(o + static_cast<int64_t>(h) * d + i0 + 4 * s, acc[h][s]);
}

template <int HB, typename T>
inline void value_rows(float* o, int d, const float (*p)[kTile8], const T* vt, int n, Prefetcher& pf) {
  int i = 0;
  for (; i + 16 <= d; i += 16) value_block<HB, 2, T>(o, d, i, p, vt, n, pf);
  if (i < d) value_block<HB, 1, T>(o, d, i, p, vt, n, pf);
}

// f(std::integral_constant<int, hb>{}) for a head block of hb in 1..4.
template <typename F>
inline void with_block(int hb, F&& f) {
  if (hb == 4) f(std::integral_constant<int, 4>{});
  else if (hb == 3) f(std::integral_constant<int, 3>{});
  else if (hb == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

// A tile's 8 scales (an int8 cache's rows), 1 past its n keys.
inline void tile_scales(const float* s, int n, float32x4_t& lo, float32x4_t& hi) {
  float tmp[kTile8];
  for (int j = 0; j < kTile8; ++j) tmp[j] = j < n ? s[j] : 1.f;
  lo = vld1q_f32(tmp);
  hi = vld1q_f32(tmp + 4);
}

template <typename T>
void task(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1, float* o,
          Partial* part) {
  alignas(16) float probs[kMaxRep][kTile8];
  float32x4_t a[4 * kTile8];  // one head block's lane-partial scores
  float ref[kMaxRep];
  float32x4_t sums[kMaxRep];
  for (int r = 0; r < rep; ++r) {
    std::fill(o + static_cast<int64_t>(r) * d, o + static_cast<int64_t>(r + 1) * d, 0.f);
    ref[r] = -std::numeric_limits<float>::infinity();
    sums[r] = vdupq_n_f32(0.f);
  }
  const int32x4_t lane_lo = {0, 1, 2, 3}, lane_hi = {4, 5, 6, 7};
  const float32x4_t minus_inf = vdupq_n_f32(-std::numeric_limits<float>::infinity());
  // The next tile's lines are prefetched spread over this tile's inner iterations (Prefetcher).
  const int tile_lines = kTile8 * d * static_cast<int>(sizeof(T)) / 64;
  int steps = 0;
  for (int r0 = 0; r0 < rep; r0 += 4) {
    const int hb = std::min(4, rep - r0);
    steps += kTile8 / key_block(hb) * (d / 8) + (d + 15) / 16 * kTile8;  // score_block's steps, value_block's rows
  }
  const int per_step = (2 * tile_lines + steps - 1) / steps;
  for (int j0 = k0; j0 < k1; j0 += kTile8) {
    const int n = std::min(kTile8, k1 - j0);
    const uint32x4_t live_lo = vcltq_s32(lane_lo, vdupq_n_s32(n)), live_hi = vcltq_s32(lane_hi, vdupq_n_s32(n));
    const T* kt = k + static_cast<int64_t>(j0) * d;
    const T* vt = v + static_cast<int64_t>(j0) * d;
    Prefetcher pf{reinterpret_cast<const char*>(kt + kTile8 * d), reinterpret_cast<const char*>(vt + kTile8 * d),
                  tile_lines, per_step};
    // An int8 key's dot product times its row's scale, its value's scale on the probability; else 1.
    float32x4_t kscale[2] = {vdupq_n_f32(1.f), vdupq_n_f32(1.f)}, vscale[2] = {kscale[0], kscale[1]};
    if (rs.k) tile_scales(rs.k + j0, n, kscale[0], kscale[1]);
    if (rs.v) tile_scales(rs.v + j0, n, vscale[0], vscale[1]);
    for (int r0 = 0; r0 < rep; r0 += 4) {  // scores and their softmax, one head block at a time
      const int hb = std::min(4, rep - r0);
      with_block(hb, [&](auto block) {
        score_tile<decltype(block)::value, T>(q + static_cast<int64_t>(r0) * d, d, kt, n, a, pf);
      });
      for (int h = r0; h < r0 + hb; ++h) {
        const float32x4_t* ah = a + (h - r0) * kTile8;
        const float32x4_t sc_lo = vbslq_f32(live_lo, vmulq_f32(sum4x4(ah), kscale[0]), minus_inf);
        const float32x4_t sc_hi = vbslq_f32(live_hi, vmulq_f32(sum4x4(ah + 4), kscale[1]), minus_inf);
        const float tile_max = vmaxvq_f32(vmaxq_f32(sc_lo, sc_hi));
        if (tile_max > ref[h] + kSlack) {
          // A new reference: the exact max so far; what was summed under the old one is scaled to it (by 0 on
          // the first tile, whose reference is -inf, where the outputs and sums are still 0).
          const float m_new = std::max(ref[h], tile_max);
          const float32x4_t c = exp4(vdupq_n_f32(ref[h] - m_new));
          float* orow = o + static_cast<int64_t>(h) * d;
          for (int i = 0; i < d; i += 4) vst1q_f32(orow + i, vmulq_f32(vld1q_f32(orow + i), c));
          sums[h] = vmulq_f32(sums[h], c);
          ref[h] = m_new;
        }
        const float32x4_t ref_h = vdupq_n_f32(ref[h]);
        const float32x4_t p_lo = exp4(vsubq_f32(sc_lo, ref_h)), p_hi = exp4(vsubq_f32(sc_hi, ref_h));
        sums[h] = vaddq_f32(sums[h], vaddq_f32(p_lo, p_hi));
        vst1q_f32(probs[h], vmulq_f32(p_lo, vscale[0]));
        vst1q_f32(probs[h] + 4, vmulq_f32(p_hi, vscale[1]));
      }
    }
    for (int r0 = 0; r0 < rep; r0 += 4)  // values, one head block at a time
      with_block(std::min(4, rep - r0), [&](auto block) {
        value_rows<decltype(block)::value, T>(o + static_cast<int64_t>(r0) * d, d, probs + r0, vt, n, pf);
      });
  }
  for (int r = 0; r < rep; ++r) part[r] = {ref[r], vaddvq_f32(sums[r])};
}

}  // namespace

void task_neon(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_neon(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}
void task_neon(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part) {
  task(q, rep, d, k, v, rs, k0, k1, o, part);
}

}  // namespace attention
}  // namespace mosaic
