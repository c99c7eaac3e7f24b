// The backbone's rows in NEON (backbone_rows.h): 16 columns a step in four accumulators per token, so the
// FMA latency is hidden; tails through the scalar arithmetic.
#include <arm_neon.h>

#include "backbone_rows.h"
#include "simd_neon.h"

namespace mosaic::detail {
namespace {

// Sixteen columns a step: load(c, w) puts the weights c..c+15 in w as floats (E4M3 as its value times 2^-8).
template <typename Load>
inline void row_loop(int cols, const float* x, int ldx, int nt, float32x4_t (*acc)[4], Load load, int& c) {
  for (c = 0; c + 16 <= cols; c += 16) {
    float32x4_t w[4];
    load(c, w);
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < 4; ++j) acc[t][j] = vfmaq_f32(acc[t][j], w[j], vld1q_f32(x + t * ldx + c + 4 * j));
  }
}

template <int NT>
void bf16_row(const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
  float32x4_t acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vdupq_n_f32(0.f);
  int c = 0;
  row_loop(cols, x, ldx, NT, acc, [w](int c0, float32x4_t* v) {
    neon::widen_bf16(w + c0, v[0], v[1]);
    neon::widen_bf16(w + c0 + 8, v[2], v[3]);
  }, c);
  for (int t = 0; t < NT; ++t) {
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[t][0], acc[t][1]), vaddq_f32(acc[t][2], acc[t][3])));
    for (int j = c; j < cols; ++j) s += bf16_to_f32(w[j]) * x[t * ldx + j];
    y[t * ldy] = s;
  }
}

template <int NT, bool Fp8>
void code_row(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  float32x4_t acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vdupq_n_f32(0.f);
  int c = 0;
  row_loop(cols, x, ldx, NT, acc, [w](int c0, float32x4_t* v) {
    for (int h = 0; h < 2; ++h) {
      if (Fp8) neon::widen_f16(neon::e4m3_as_f16(vld1_u8(w + c0 + 8 * h)), v[2 * h], v[2 * h + 1]);
      else neon::widen_i8(vld1_s8(reinterpret_cast<const int8_t*>(w + c0 + 8 * h)), v[2 * h], v[2 * h + 1]);
    }
  }, c);
  for (int t = 0; t < NT; ++t) {
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[t][0], acc[t][1]), vaddq_f32(acc[t][2], acc[t][3])));
    if (Fp8) s *= 256.f;  // the f16 route's 2^-8, undone before the exact tail joins
    for (int j = c; j < cols; ++j)
      s += code_value<Fp8>(w[j]) * x[t * ldx + j];
    y[t * ldy] = scale * s;
  }
}

template <bool Fp8>
void code_rows(const uint8_t* w, int cols, const float* x, int ldx, int nt, float scale, float* y, int ldy) {
  for_tokens(nt, [&](auto NT) { code_row<decltype(NT)::value, Fp8>(w, cols, x, ldx, scale, y, ldy); });
}

void bf16_rows(const uint16_t* w, int nrows, int cols, const float* x, int ldx, int nt, float* y, int ldy) {
  for (int i = 0; i < nrows; ++i)
    for_tokens(nt, [&](auto NT) { bf16_row<decltype(NT)::value>(w + i * cols, cols, x, ldx, y + i, ldy); });
}

}  // namespace

BackboneRows backbone_rows_neon() { return {bf16_rows, code_rows<false>, code_rows<true>}; }

}  // namespace mosaic::detail
