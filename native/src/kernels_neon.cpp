// NEON expert kernels (AArch64): the float ones widen codes to float and multiply-add four lanes at a
// time, four tokens sharing each widened block; partial last blocks go through the reference's arithmetic.
// Isa::NeonDot runs Q4 and MXFP4 against int8 activations with SDOT (FEAT_DotProd), as llama.cpp's NEON
// Q4_0 path does.
#include <arm_neon.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mosaic/kernels.h"
#include "simd_neon.h"

#if defined(__clang__)
#define MOSAIC_DOTPROD __attribute__((target("dotprod")))
#else
#define MOSAIC_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

namespace mosaic {
namespace {

constexpr int kTokTile = 4;

inline float32x4_t widen4(uint8x16_t v, int quarter) {  // bytes 4q..4q+3 as floats
  const uint16x8_t h = quarter < 2 ? vmovl_u8(vget_low_u8(v)) : vmovl_u8(vget_high_u8(v));
  const uint32x4_t w = quarter % 2 == 0 ? vmovl_u16(vget_low_u16(h)) : vmovl_u16(vget_high_u16(h));
  return vcvtq_f32_u32(w);
}

inline float32x4_t widen4(int8x16_t v, int quarter) {  // bytes 4q..4q+3 as floats, signed
  const int16x8_t h = quarter < 2 ? vmovl_s8(vget_low_s8(v)) : vmovl_s8(vget_high_s8(v));
  const int32x4_t w = quarter % 2 == 0 ? vmovl_s16(vget_low_s16(h)) : vmovl_s16(vget_high_s16(h));
  return vcvtq_f32_s32(w);
}

// acc[t] += the 32 weights w[0..7] (four floats each) against token t's 32 activations.
inline void block_fma(const float32x4_t* w, const float* x, int ldx, int nt, float32x4_t* acc) {
  for (int t = 0; t < nt; ++t) {
    const float* xt = x + static_cast<uint64_t>(t) * ldx;
    for (int j = 0; j < 8; ++j) acc[t] = vfmaq_f32(acc[t], w[j], vld1q_f32(xt + 4 * j));
  }
}

// Q4 and MXFP4 in float: a block's 32 weights as floats, in element order, then block_fma. Unpack(block,
// scale index, w) fills w[0..7].
template <typename Unpack, typename Tail>
void nibble_matvec(const MatvecArgs& a, Unpack unpack, Tail tail) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4, whole = a.cols / kQ4;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint64_t s0 = static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      const float* x = a.x + static_cast<uint64_t>(t0) * a.ldx;
      float32x4_t acc[kTokTile] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
      for (int b = 0; b < whole; ++b) {
        float32x4_t w[8];
        unpack(row + b * kQ4Bytes, s0 + b, w);
        block_fma(w, x + b * kQ4, a.ldx, nt, acc);
      }
      for (int t = 0; t < nt; ++t) {
        float s = vaddvq_f32(acc[t]);
        if (whole < blocks) s += tail(row + whole * kQ4Bytes, s0 + whole, x + static_cast<uint64_t>(t) * a.ldx + whole * kQ4,
                                      a.cols - whole * kQ4);
        a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = s;
      }
    }
  }
}

void q4_neon(const MatvecArgs& a) {
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  nibble_matvec(
      a,
      [&](const uint8_t* p, uint64_t s, float32x4_t* w) {  // byte j: elements j (low nibble) and j + 16 (high)
        const uint8x16_t v = vld1q_u8(p);
        const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, low4)), vdupq_n_s8(8));
        const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
        const float d = f16_to_f32(scales[s]);
        for (int q = 0; q < 4; ++q) {
          w[q] = vmulq_n_f32(widen4(lo, q), d);
          w[4 + q] = vmulq_n_f32(widen4(hi, q), d);
        }
      },
      [&](const uint8_t* p, uint64_t s, const float* x, int len) { return f16_to_f32(scales[s]) * q4_partial_dot(p, x, len); });
}

// 2 * e2m1 by code, as int8: MXFP4 codes become small integers (the scale is halved to match).
const int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// A block's 32 MXFP4 codes as doubled E2M1 integers in element order (byte j: elements 2j and 2j + 1).
inline void mxfp4_codes(const uint8_t* p, int8x16_t& e0, int8x16_t& e1) {
  const int8x16_t table = vld1q_s8(kE2m1Doubled);
  const uint8x16_t v = vld1q_u8(p);
  const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(v, vdupq_n_u8(0x0F)));
  const int8x16_t hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
  e0 = vzip1q_s8(lo, hi);  // elements 0..15
  e1 = vzip2q_s8(lo, hi);  // 16..31
}

void mxfp4_neon(const MatvecArgs& a) {
  const auto* scales = static_cast<const uint8_t*>(a.scales);
  nibble_matvec(
      a,
      [&](const uint8_t* p, uint64_t s, float32x4_t* w) {
        int8x16_t e0, e1;
        mxfp4_codes(p, e0, e1);
        const float d = 0.5f * e8m0_to_f32(scales[s]);
        for (int q = 0; q < 4; ++q) {
          w[q] = vmulq_n_f32(widen4(e0, q), d);
          w[4 + q] = vmulq_n_f32(widen4(e1, q), d);
        }
      },
      [&](const uint8_t* p, uint64_t s, const float* x, int len) { return e8m0_to_f32(scales[s]) * mxfp4_partial_dot(p, x, len); });
}

// FP8: 128-column blocks, 8 codes widened through f16 at a time (value times 2^-8, undone per block).
void fp8_neon(const MatvecArgs& a) {
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    const uint64_t srow = static_cast<uint64_t>(r / kFp8) * scale_cols;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      float total[kTokTile] = {0.f, 0.f, 0.f, 0.f};
      for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
        const int end = std::min(c0 + kFp8, a.cols), vec_end = c0 + (end - c0) / 8 * 8;
        float32x4_t acc[kTokTile] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
        for (int c = c0; c < vec_end; c += 8) {
          float32x4_t lo, hi;
          neon::widen_f16(neon::e4m3_as_f16(vld1_u8(row + c)), lo, hi);
          for (int t = 0; t < nt; ++t) {
            const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c;
            acc[t] = vfmaq_f32(vfmaq_f32(acc[t], lo, vld1q_f32(x)), hi, vld1q_f32(x + 4));
          }
        }
        const float s = scale_at(a.scales, a.scale_dtype, srow + c0 / kFp8);
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx;
          float tail = 0.f;
          for (int c = vec_end; c < end; ++c) tail += e4m3_to_f32(row[c]) * x[c];
          total[t] += (vaddvq_f32(acc[t]) * 256.f + tail) * s;
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = total[t];
    }
  }
}

// --- Q4 and MXFP4 against int8 activations (SDOT) ------------------------------------------------
// x is quantised once per call to int8 per 32-block (scale sx = amax/127, rounded to nearest even), as the
// x86 int8 kernels do; elements past the last column are zero. The weights become signed integers (Q4:
// code - 8; MXFP4: 2 * e2m1, its scale halved), so each block is two SDOTs into four int32 lanes, scaled
// by d * sx into a float accumulator. Activations lose about 0.4 % (int8); weights are exact.
struct QuantisedX {
  std::vector<int8_t> q;   // [n][blocks * 32]
  std::vector<float> sx;   // [n][blocks]
};

void quantise_x(const MatvecArgs& a, int blocks, QuantisedX& out) {
  out.q.assign(static_cast<size_t>(a.n) * blocks * kQ4, 0);  // capacity kept across calls
  out.sx.assign(static_cast<size_t>(a.n) * blocks, 0.f);
  for (int t = 0; t < a.n; ++t) {
    const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
    for (int b = 0; b < blocks; ++b) {
      const int c0 = b * kQ4, len = std::min(kQ4, a.cols - c0);
      alignas(16) float v[kQ4] = {};
      std::memcpy(v, x + c0, sizeof(float) * len);
      float32x4_t m = vdupq_n_f32(0.f);
      for (int j = 0; j < 8; ++j) m = vmaxq_f32(m, vabsq_f32(vld1q_f32(v + 4 * j)));
      const float amax = vmaxvq_f32(m), inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = out.q.data() + (static_cast<size_t>(t) * blocks + b) * kQ4;
      for (int j = 0; j < 8; j += 2) {
        const int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(v + 4 * j), inv));  // nearest even
        const int32x4_t i1 = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(v + 4 * j + 4), inv));
        vst1_s8(q + 4 * j, vqmovn_s16(vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1))));
      }
      out.sx[static_cast<size_t>(t) * blocks + b] = amax / 127.f;
    }
  }
}

template <bool Mx>
MOSAIC_DOTPROD void int8_matvec(const MatvecArgs& a) {
  thread_local QuantisedX qx;
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  quantise_x(a, blocks, qx);
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint64_t s0 = static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      float32x4_t acc[kTokTile] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
      for (int b = 0; b < blocks; ++b) {
        int8x16_t w0, w1;  // elements 0..15 and 16..31 of the block, as signed integers
        float d;
        if constexpr (Mx) {
          mxfp4_codes(row + b * kQ4Bytes, w0, w1);
          d = 0.5f * e8m0_to_f32(static_cast<const uint8_t*>(a.scales)[s0 + b]);
        } else {
          const uint8x16_t v = vld1q_u8(row + b * kQ4Bytes);
          w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, low4)), vdupq_n_s8(8));
          w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
          d = f16_to_f32(static_cast<const uint16_t*>(a.scales)[s0 + b]);
        }
        for (int t = 0; t < nt; ++t) {
          const size_t at = static_cast<size_t>(t0 + t) * blocks + b;
          const int8_t* q = qx.q.data() + at * kQ4;
          const int32x4_t dot = vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, vld1q_s8(q)), w1, vld1q_s8(q + 16));
          acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(dot), d * qx.sx[at]);
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = vaddvq_f32(acc[t]);
    }
  }
}

void q4_neon_dot(const MatvecArgs& a) { int8_matvec<false>(a); }
void mxfp4_neon_dot(const MatvecArgs& a) { int8_matvec<true>(a); }

}  // namespace

IsaKernels neon_kernels() { return {q4_neon, fp8_neon, mxfp4_neon}; }
IsaKernels neon_dot_kernels() { return {q4_neon_dot, fp8_neon, mxfp4_neon_dot}; }

}  // namespace mosaic
