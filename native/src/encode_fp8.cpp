// The FP8_B128 encoder (encode.h), the same arithmetic as quant.quantize_fp8_reference: per 128 x 128 tile
// the scale amax / 448 in float32 (1 for an all-zero tile), each weight divided by it, clamped to +-448 and
// rounded to E4M3FN as torch's conversion rounds (c10's fp8e4m3fn_from_fp32_value: nearest, ties to even).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

#include "mosaic/encode.h"
#include "mosaic/kernels.h"

namespace mosaic {
namespace {

constexpr int kTile = 128;
constexpr float kMax = 448.f;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// float -> E4M3FN bits, nearest with ties to even; past the largest finite value, NaN (callers clamp first).
// Both roundings are computed and one is kept, without branches, so that the loops over a tile vectorise.
inline uint8_t to_e4m3fn(float f) {
  constexpr uint32_t kNanFrom = 1087u << 20;  // 480, the step past 448: NaN from there (as torch)
  constexpr uint32_t kSubnormal = 121u << 23;  // 2^-6, the smallest normal E4M3 value
  constexpr uint32_t kDenormMagic = 141u << 23;  // 2^14: its ulp is E4M3's subnormal step, 2^-9
  uint32_t u = bits_of(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // below 2^-6 the float unit rounds to a multiple of 2^-9 (ties to even) when 2^14 is added
  const uint32_t subnormal = bits_of(float_of(u) + float_of(kDenormMagic)) - kDenormMagic;
  // above, the mantissa is cut to 3 bits, ties to even on the last kept bit
  const uint32_t normal = (u + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + ((u >> 20) & 1u)) >> 20;
  const uint32_t below = 0u - static_cast<uint32_t>(u < kSubnormal), nan = 0u - static_cast<uint32_t>(u >= kNanFrom);
  const uint32_t code = (((subnormal & below) | (normal & ~below)) & ~nan) | (0x7Fu & nan);
  return static_cast<uint8_t>(code | (sign >> 24));
}

inline float widen(const float* row, int i) { return row[i]; }
inline float widen(const uint16_t* row, int i) { return bf16_to_f32(row[i]); }

template <typename T>
EncodeStatus encode(const T* w, int64_t rows, int cols, uint8_t* codes, float* scales, int threads) {
  const int64_t bands = (rows + kTile - 1) / kTile;
  const int tiles = (cols + kTile - 1) / kTile;
  int status = static_cast<int>(EncodeStatus::Ok);
#pragma omp parallel for num_threads(threads) schedule(dynamic) reduction(max : status)
  for (int64_t t = 0; t < bands * tiles; ++t) {
    const int64_t band = t / tiles, r0 = band * kTile, r1 = std::min<int64_t>(rows, r0 + kTile);
    const int c0 = static_cast<int>(t % tiles) * kTile, c1 = std::min(cols, c0 + kTile);
    // |x| as bits: for non-negative floats their order is the values' order, and an integer maximum
    // vectorises; inf and nan sort above every finite value
    uint32_t amax_bits = 0;
    for (int64_t r = r0; r < r1; ++r)
      for (int c = c0; c < c1; ++c) amax_bits = std::max(amax_bits, bits_of(widen(w + r * cols, c)) & 0x7FFFFFFFu);
    if (amax_bits >= 0x7F800000u) {
      status = std::max(status, static_cast<int>(EncodeStatus::NotFinite));
      continue;
    }
    const float amax = float_of(amax_bits);
    const float scale = amax > 0.f ? amax / kMax : 1.f;
    scales[band * tiles + t % tiles] = scale;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = w + r * cols;
      uint8_t* out = codes + r * cols;
      for (int c = c0; c < c1; ++c) {
        float q = widen(row, c) / scale;
        q = q < -kMax ? -kMax : q;
        q = q > kMax ? kMax : q;
        out[c] = to_e4m3fn(q);
      }
    }
  }
  return static_cast<EncodeStatus>(status);
}

}  // namespace

EncodeStatus encode_fp8(EncodeInput w, uint8_t* codes, float* scales, int threads) {
  return w.bf16 ? encode(static_cast<const uint16_t*>(w.data), w.rows, w.cols, codes, scales, threads)
                : encode(static_cast<const float*>(w.data), w.rows, w.cols, codes, scales, threads);
}

}  // namespace mosaic
