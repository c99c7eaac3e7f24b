// NEON helpers shared by the AArch64 kernels (internal to native/src).
#pragma once

#include <arm_neon.h>

#include <cstdint>

namespace mosaic::neon {

// 8 bf16 values widened to floats: a bf16 is a float's top half.
inline void widen_bf16(const uint16_t* p, float32x4_t& lo, float32x4_t& hi) {
  const uint16x8_t v = vld1q_u16(p);
  lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
  hi = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(v), 16));
}

// 8 E4M3 bytes as f16 bit patterns: sign to bit 15, exponent and mantissa shifted left by 7. As an f16 that
// is the value times 2^-8 for normals and subnormals alike, so callers fold 2^8 into their scale.
inline uint16x8_t e4m3_as_f16(uint8x8_t b) {
  const uint16x8_t w = vmovl_u8(b);
  return vorrq_u16(vshlq_n_u16(vandq_u16(w, vdupq_n_u16(0x7F)), 7), vshlq_n_u16(vandq_u16(w, vdupq_n_u16(0x80)), 8));
}

inline void widen_f16(uint16x8_t h, float32x4_t& lo, float32x4_t& hi) {
  lo = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
  hi = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
}

// 8 int8 codes widened to floats.
inline void widen_i8(int8x8_t b, float32x4_t& lo, float32x4_t& hi) {
  const int16x8_t w = vmovl_s8(b);
  lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
  hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w)));
}

}  // namespace mosaic::neon
