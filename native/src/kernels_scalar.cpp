// Scalar reference kernels: the definition every SIMD variant is tested against.
#include <cmath>
#include <cstring>

#include "mosaic/kernels.h"

namespace mosaic {

float f16_to_f32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(mant), -24);
  else if (exp == 31) v = mant ? NAN : INFINITY;
  else v = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits |= sign;
  std::memcpy(&v, &bits, 4);
  return v;
}

float e4m3_to_f32(uint8_t b) {  // E4M3FN: bias 7, no infinities
  const int exp = (b >> 3) & 0xF, mant = b & 0x7;
  float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9) : std::ldexp(static_cast<float>(8 + mant), exp - 10);
  if (exp == 15 && mant == 7) v = NAN;
  return (b & 0x80) ? -v : v;
}

namespace {

void q4_scalar(const MatvecArgs& a) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  float w[kQ4];
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    for (int t = 0; t < a.n; ++t) a.y[static_cast<uint64_t>(t) * a.ldy + r] = 0.f;
    for (int b = 0; b < blocks; ++b) {
      const float d = f16_to_f32(scales[static_cast<uint64_t>(r) * blocks + b]);
      for (int j = 0; j < 16; ++j) {
        w[j] = static_cast<float>(row[b * 16 + j] & 0xF) - 8.f;
        w[j + 16] = static_cast<float>(row[b * 16 + j] >> 4) - 8.f;
      }
      const int len = (b + 1) * kQ4 <= a.cols ? kQ4 : a.cols - b * kQ4;
      for (int t = 0; t < a.n; ++t) {
        const float* x = a.x + static_cast<uint64_t>(t) * a.ldx + b * kQ4;
        float s = 0.f;
        for (int j = 0; j < len; ++j) s += w[j] * x[j];
        a.y[static_cast<uint64_t>(t) * a.ldy + r] += d * s;
      }
    }
  }
}

void fp8_scalar(const MatvecArgs& a) {
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    for (int t = 0; t < a.n; ++t) {
      const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
      float acc = 0.f;
      for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
        const int end = c0 + kFp8 < a.cols ? c0 + kFp8 : a.cols;
        float s = 0.f;
        for (int c = c0; c < end; ++c) s += e4m3_to_f32(row[c]) * x[c];
        acc += s * scale_at(a.scales, a.scale_dtype, static_cast<uint64_t>(r / kFp8) * scale_cols + c0 / kFp8);
      }
      a.y[static_cast<uint64_t>(t) * a.ldy + r] = acc;
    }
  }
}

// MXFP4: byte j of a block holds elements 2j (low nibble) and 2j + 1 (high nibble); w = e2m1 * 2^(s - 127).
void mxfp4_scalar(const MatvecArgs& a) {
  const int blocks = (a.cols + kMxfp4 - 1) / kMxfp4;
  const auto* scales = static_cast<const uint8_t*>(a.scales);
  float w[kMxfp4];
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    for (int t = 0; t < a.n; ++t) a.y[static_cast<uint64_t>(t) * a.ldy + r] = 0.f;
    for (int b = 0; b < blocks; ++b) {
      const float d = e8m0_to_f32(scales[static_cast<uint64_t>(r) * blocks + b]);
      for (int j = 0; j < 16; ++j) {
        w[2 * j] = kE2m1[row[b * 16 + j] & 0xF];
        w[2 * j + 1] = kE2m1[row[b * 16 + j] >> 4];
      }
      const int len = (b + 1) * kMxfp4 <= a.cols ? kMxfp4 : a.cols - b * kMxfp4;
      for (int t = 0; t < a.n; ++t) {
        const float* x = a.x + static_cast<uint64_t>(t) * a.ldx + b * kMxfp4;
        float s = 0.f;
        for (int j = 0; j < len; ++j) s += w[j] * x[j];
        a.y[static_cast<uint64_t>(t) * a.ldy + r] += d * s;
      }
    }
  }
}

}  // namespace

IsaKernels scalar_kernels() { return {q4_scalar, fp8_scalar, mxfp4_scalar}; }

}  // namespace mosaic
