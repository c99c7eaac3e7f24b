// The NEON task of decode attention (attention_task.h): the AVX2 task's order at NEON's width. Keys outer
// and the group's query heads inner, so each key or value row is read from memory once and from L1 by the
// other heads; scores, then the softmax, then the values. head_dim a multiple of 8.
#include <arm_neon.h>

#include <algorithm>
#include <vector>

#include "attention_task.h"
#include "simd_neon.h"

namespace mosaic {
namespace attention {
namespace {

inline void widen8(const float* p, float32x4_t& lo, float32x4_t& hi) {
  lo = vld1q_f32(p);
  hi = vld1q_f32(p + 4);
}
inline void widen8(const uint16_t* p, float32x4_t& lo, float32x4_t& hi) { neon::widen_bf16(p, lo, hi); }
inline void widen8(const int8_t* p, float32x4_t& lo, float32x4_t& hi) { neon::widen_i8(vld1_s8(p), lo, hi); }

template <typename T>
void task(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1, float* o,
          Partial* part) {
  thread_local std::vector<float> scores;  // [rep][k1 - k0]
  const int n = k1 - k0;
  scores.resize(static_cast<size_t>(rep) * n);
  for (int j = 0; j < n; ++j) {
    const T* kr = k + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) __builtin_prefetch(kr + 4 * d);
    for (int r = 0; r < rep; ++r) {
      const float* qr = q + static_cast<int64_t>(r) * d;
      float32x4_t a0 = vdupq_n_f32(0.f), a1 = vdupq_n_f32(0.f);
      for (int i = 0; i < d; i += 8) {
        float32x4_t lo, hi;
        widen8(kr + i, lo, hi);
        a0 = vfmaq_f32(a0, vld1q_f32(qr + i), lo);
        a1 = vfmaq_f32(a1, vld1q_f32(qr + i + 4), hi);
      }
      const float dot = vaddvq_f32(vaddq_f32(a0, a1));
      scores[static_cast<size_t>(r) * n + j] = rs.k ? dot * rs.k[k0 + j] : dot;
    }
  }
  softmax_rows(scores.data(), rep, n, rs.v ? rs.v + k0 : nullptr, part);
  std::fill(o, o + static_cast<int64_t>(rep) * d, 0.f);
  for (int j = 0; j < n; ++j) {
    const T* vr = v + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) __builtin_prefetch(vr + 4 * d);
    for (int r = 0; r < rep; ++r) {
      const float32x4_t p = vdupq_n_f32(scores[static_cast<size_t>(r) * n + j]);
      float* orow = o + static_cast<int64_t>(r) * d;
      for (int i = 0; i < d; i += 8) {
        float32x4_t lo, hi;
        widen8(vr + i, lo, hi);
        vst1q_f32(orow + i, vfmaq_f32(vld1q_f32(orow + i), p, lo));
        vst1q_f32(orow + i + 4, vfmaq_f32(vld1q_f32(orow + i + 4), p, hi));
      }
    }
  }
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
