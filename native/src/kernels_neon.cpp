// NEON expert kernels (AArch64): the float ones widen codes to float and multiply-add four lanes at a
// time, four tokens sharing each widened block; partial last blocks go through the reference's arithmetic.
// Isa::NeonDot runs Q4 and MXFP4 against int8 activations with SDOT (FEAT_DotProd), as llama.cpp's NEON
// Q4_0 path does; Isa::NeonI8mm runs a prefill's rows and tokens in 2 x 2 tiles with SMMLA (FEAT_I8MM).
#include <arm_neon.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mosaic/kernels.h"
#include "prefill_blocks.h"
#include "simd_neon.h"

#if defined(__clang__)
#define MOSAIC_DOTPROD __attribute__((target("dotprod")))
#define MOSAIC_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define MOSAIC_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define MOSAIC_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
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

// Row r's block b as signed integers, elements 0..15 in w0 and 16..31 in w1, and its scale (MXFP4's halved,
// its codes being doubled).
template <bool Mx>
inline float signed_block(const MatvecArgs& a, const uint8_t* row, uint64_t s0, int b, int8x16_t& w0, int8x16_t& w1) {
  if constexpr (Mx) {
    mxfp4_codes(row + b * kQ4Bytes, w0, w1);
    return 0.5f * e8m0_to_f32(static_cast<const uint8_t*>(a.scales)[s0 + b]);
  } else {
    const uint8x16_t v = vld1q_u8(row + b * kQ4Bytes), low4 = vdupq_n_u8(0x0F);
    w0 = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, low4)), vdupq_n_s8(8));
    w1 = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(8));
    return f16_to_f32(static_cast<const uint16_t*>(a.scales)[s0 + b]);
  }
}

// Rows [r0, r1) against tokens [t0, t0 + nt), nt <= kTokTile.
template <bool Mx>
MOSAIC_DOTPROD void sdot_rows(const MatvecArgs& a, const QuantisedX& qx, int blocks, int r0, int r1, int t0, int nt) {
  for (int r = r0; r < r1; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint64_t s0 = static_cast<uint64_t>(r) * blocks;
    float32x4_t acc[kTokTile] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    for (int b = 0; b < blocks; ++b) {
      int8x16_t w0, w1;
      const float d = signed_block<Mx>(a, row, s0, b, w0, w1);
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

template <bool Mx>
MOSAIC_DOTPROD void int8_matvec(const MatvecArgs& a) {
  thread_local QuantisedX qx;
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  quantise_x(a, blocks, qx);
  // Row panels in L2, token tiles in L1 (prefill_blocks.h).
  const int panel = a.n > kTokTile ? detail::prefill_row_panel(static_cast<size_t>(blocks) * kQ4Bytes) : a.rows;
  for (int r0 = 0; r0 < a.rows; r0 += panel)
    for (int t0 = 0; t0 < a.n; t0 += kTokTile)
      sdot_rows<Mx>(a, qx, blocks, r0, std::min(a.rows, r0 + panel), t0, std::min(kTokTile, a.n - t0));
}

// --- A prefill in 2 x 2 tiles (SMMLA, FEAT_I8MM) --------------------------------------------------
// SMMLA multiplies a 2 x 8 matrix of int8 by the transpose of another into 2 x 2 int32 sums: two rows' 8
// codes against two tokens' 8 activations. A block of 32 is four of them for four row-token sums, where
// SDOT takes eight instructions; each 2 x 2 is then scaled by [d0 s0, d0 s1, d1 s0, d1 s1]. The quantised
// activations (the SDOT loop's, so the two round alike) are interleaved by token pair once per call; a lone
// last token pairs with a zero one, a lone last row with itself. A decode step (one token) runs SDOT.
struct PairedX {
  std::vector<int8_t> q;  // [pairs][blocks][4][2][8]: chunk c of a block is its elements 8c..8c+7, each token's
  std::vector<float> sx;  // [pairs][blocks][4]: s0, s1, s0, s1, the order of SMMLA's sums
};

inline int8x16_t zip_lo(int8x16_t x, int8x16_t y) {  // x's first 8 bytes, then y's
  return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}
inline int8x16_t zip_hi(int8x16_t x, int8x16_t y) {  // x's last 8 bytes, then y's
  return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)));
}

void pair_tokens(const QuantisedX& qx, int n, int blocks, PairedX& out) {
  const int pairs = (n + 1) / 2;
  out.q.assign(static_cast<size_t>(pairs) * blocks * 64, 0);  // capacity kept across calls
  out.sx.assign(static_cast<size_t>(pairs) * blocks * 4, 0.f);
  for (int p = 0; p < pairs; ++p) {
    const size_t t0 = 2 * static_cast<size_t>(p);
    const bool two = static_cast<int>(t0) + 1 < n;
    for (int b = 0; b < blocks; ++b) {
      const size_t at = t0 * blocks + b;
      const int8_t* x0 = qx.q.data() + at * kQ4;
      const int8x16_t zero = vdupq_n_s8(0);
      const int8x16_t a0 = vld1q_s8(x0), a1 = vld1q_s8(x0 + 16);
      const int8x16_t b0 = two ? vld1q_s8(x0 + static_cast<size_t>(blocks) * kQ4) : zero;
      const int8x16_t b1 = two ? vld1q_s8(x0 + static_cast<size_t>(blocks) * kQ4 + 16) : zero;
      int8_t* o = out.q.data() + (static_cast<size_t>(p) * blocks + b) * 64;
      vst1q_s8(o, zip_lo(a0, b0));
      vst1q_s8(o + 16, zip_hi(a0, b0));
      vst1q_s8(o + 32, zip_lo(a1, b1));
      vst1q_s8(o + 48, zip_hi(a1, b1));
      const float s0 = qx.sx[at], s1 = two ? qx.sx[at + blocks] : 0.f;
      float* s = out.sx.data() + (static_cast<size_t>(p) * blocks + b) * 4;
      s[0] = s0, s[1] = s1, s[2] = s0, s[3] = s1;
    }
  }
}

constexpr int kPairTile = 4;  // token pairs a row pair's unpacked codes serve

// Row pairs from r0 (r1 exclusive) against token pairs [p0, p0 + np), np <= kPairTile.
template <bool Mx>
MOSAIC_I8MM void smmla_rows(const MatvecArgs& a, const PairedX& px, int blocks, int r0, int r1, int p0, int np) {
  for (int r = r0; r < r1; r += 2) {
    const bool two_rows = r + 1 < r1;
    const uint8_t* row0 = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint8_t* row1 = two_rows ? row0 + static_cast<uint64_t>(blocks) * kQ4Bytes : row0;
    const uint64_t s0 = static_cast<uint64_t>(r) * blocks, s1 = two_rows ? s0 + blocks : s0;
    float32x4_t acc[kPairTile] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    for (int b = 0; b < blocks; ++b) {
      int8x16_t u0, u1, v0, v1;
      const float d0 = signed_block<Mx>(a, row0, s0, b, u0, u1), d1 = signed_block<Mx>(a, row1, s1, b, v0, v1);
      const int8x16_t m0 = zip_lo(u0, v0), m1 = zip_hi(u0, v0), m2 = zip_lo(u1, v1), m3 = zip_hi(u1, v1);
      const float32x4_t d = vcombine_f32(vdup_n_f32(d0), vdup_n_f32(d1));
      for (int i = 0; i < np; ++i) {
        const size_t at = static_cast<size_t>(p0 + i) * blocks + b;
        const int8_t* q = px.q.data() + at * 64;
        int32x4_t sums = vmmlaq_s32(vdupq_n_s32(0), m0, vld1q_s8(q));
        sums = vmmlaq_s32(sums, m1, vld1q_s8(q + 16));
        sums = vmmlaq_s32(sums, m2, vld1q_s8(q + 32));
        sums = vmmlaq_s32(sums, m3, vld1q_s8(q + 48));
        acc[i] = vfmaq_f32(acc[i], vcvtq_f32_s32(sums), vmulq_f32(d, vld1q_f32(px.sx.data() + at * 4)));
      }
    }
    for (int i = 0; i < np; ++i) {
      const int t = 2 * (p0 + i);
      float* y0 = a.y + static_cast<uint64_t>(t) * a.ldy + r;
      y0[0] = vgetq_lane_f32(acc[i], 0);
      if (two_rows) y0[1] = vgetq_lane_f32(acc[i], 2);
      if (t + 1 < a.n) {
        y0[a.ldy] = vgetq_lane_f32(acc[i], 1);
        if (two_rows) y0[a.ldy + 1] = vgetq_lane_f32(acc[i], 3);
      }
    }
  }
}

template <bool Mx>
MOSAIC_I8MM void int8_matmul(const MatvecArgs& a) {
  if (a.n == 1) return int8_matvec<Mx>(a);
  thread_local QuantisedX qx;
  thread_local PairedX px;
  const int blocks = (a.cols + kQ4 - 1) / kQ4, pairs = (a.n + 1) / 2;
  quantise_x(a, blocks, qx);
  pair_tokens(qx, a.n, blocks, px);
  // Row panels in L2 (an even number of rows), token tiles in L1 (prefill_blocks.h).
  const int panel = std::max(2, detail::prefill_row_panel(static_cast<size_t>(blocks) * kQ4Bytes) / 2 * 2);
  for (int r0 = 0; r0 < a.rows; r0 += panel)
    for (int p0 = 0; p0 < pairs; p0 += kPairTile)
      smmla_rows<Mx>(a, px, blocks, r0, std::min(a.rows, r0 + panel), p0, std::min(kPairTile, pairs - p0));
}

void q4_neon_dot(const MatvecArgs& a) { int8_matvec<false>(a); }
void mxfp4_neon_dot(const MatvecArgs& a) { int8_matvec<true>(a); }
void q4_neon_i8mm(const MatvecArgs& a) { int8_matmul<false>(a); }
void mxfp4_neon_i8mm(const MatvecArgs& a) { int8_matmul<true>(a); }

}  // namespace

IsaKernels neon_kernels() { return {q4_neon, fp8_neon, mxfp4_neon}; }
IsaKernels neon_dot_kernels() { return {q4_neon_dot, fp8_neon, mxfp4_neon_dot}; }
IsaKernels neon_i8mm_kernels() { return {q4_neon_i8mm, fp8_neon, mxfp4_neon_i8mm}; }

}  // namespace mosaic
