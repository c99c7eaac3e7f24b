// The Q4_G32 encoder (encode.h), the same arithmetic as quant.quantize_q4 step for step so that the bytes
// agree: float32 where it works in float32, the code sums in float64 in order (each product of a code and
// a float32 weight is exact in float64), f16 conversions rounding to nearest even, the double -> f16 of the
// refit scale through float as torch converts it. This file is compiled without FMA contraction
// (CMakeLists.txt): a fused multiply-add would round the error terms differently from torch's separate
// operations. Rows run through the scalar blocks here or the AVX2 or AVX-512 ones (encode_q4_avx2.cpp,
// encode_q4_avx512.cpp), chosen by best_isa(); all write the same bytes (tests/test_quant.py holds each to
// the reference).
#include <algorithm>
#include <cmath>
#include <cstring>

#include <omp.h>

#include "encode_q4_block.h"
#include "mosaic/encode.h"
#include "mosaic/kernels.h"

namespace mosaic {
namespace {

// float -> IEEE half, round to nearest even; overflow to infinity (as torch's conversion).
uint16_t to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest subnormal
    const uint32_t m = (x & 0x007FFFFFu) | 0x00800000u;
    const int shift = 126 - static_cast<int>(x >> 23);  // 14..24
    const uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    return static_cast<uint16_t>(sign | (r + (rem > halfway || (rem == halfway && (r & 1)))));
  }
  const uint32_t r = ((x - 0x38000000u) >> 13), rem = x & 0x1FFFu;
  return static_cast<uint16_t>(sign | (r + (rem > 0x1000u || (rem == 0x1000u && (r & 1)))));
}

float from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t x;
  if (e == 0) {
    if (m == 0) {
      x = sign;
    } else {  // a subnormal half is normal in float
      int shift = 0;
      uint32_t mm = m;
      while (!(mm & 0x400u)) mm <<= 1, ++shift;
      x = sign | ((113u - shift) << 23) | ((mm & 0x3FFu) << 13);
    }
  } else if (e == 31) {
    x = sign | 0x7F800000u | (m << 13);
  } else {
    x = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

struct Fit {
  float q[kQ4];
  double qw, qq, err;
};

// x rounded to the nearest integer, ties to even (as nearbyint in the default rounding mode, without a libm
// call): exact for |x| < 2^22; anything larger stays at least that large, which the clamp to [-8, 7] after it
// treats alike.
inline float round_even(float x) {
  constexpr float kShift = 12582912.f;  // 1.5 * 2^23: adding it leaves no fraction bits
  return (x + kShift) - kShift;
}

// Codes in [-8, 7] of a block under f16 scale d, with sum(q w), sum(q q) and the squared error less sum(w^2).
// The float64 sums are exact in any order (quant._q4_codes), so they run as four independent chains.
void fit(const float* w, uint16_t d, Fit& f) {
  const float d32 = from_half(d), inv = d32 != 0.f ? 1.f / d32 : 0.f;
  for (int k = 0; k < kQ4; ++k) f.q[k] = std::clamp(round_even(w[k] * inv), -8.f, 7.f);
  double qw[4] = {}, qq[4] = {};
  for (int k = 0; k < kQ4; k += 4)
    for (int j = 0; j < 4; ++j) {
      qw[j] += static_cast<double>(f.q[k + j]) * w[k + j];
      qq[j] += static_cast<double>(f.q[k + j]) * f.q[k + j];
    }
  f.qw = (qw[0] + qw[1]) + (qw[2] + qw[3]);
  f.qq = (qq[0] + qq[1]) + (qq[2] + qq[3]);
  const double d64 = d32;
  f.err = d64 * d64 * f.qq - 2 * d64 * f.qw;
}

// Element i of a row as float32: as it is, or widened from bf16 bits (exact).
inline float widen(const float* row, int i) { return row[i]; }
inline float widen(const uint16_t* row, int i) { return bf16_to_f32(row[i]); }

// One block of 32 floats: its 16 code bytes and f16 scale, or NotFinite (nothing written).
int encode_block(const float* block, uint8_t* codes, uint16_t* scale) {
  float hi = block[0], lo = block[0];
  bool finite = true;
  for (int k = 0; k < kQ4; ++k) {
    finite = finite && std::isfinite(block[k]);
    hi = std::max(hi, block[k]);
    lo = std::min(lo, block[k]);
  }
  if (!finite) return static_cast<int>(EncodeStatus::NotFinite);
  float extreme = -lo > hi ? lo : hi;  // the signed weight of largest magnitude
  if (extreme == 0.f) extreme = 0.f;  // +0 for an all-zero block, whichever zero the min and max met
  Fit f0, f1;
  const uint16_t d0 = to_half(extreme / -8.f);
  fit(block, d0, f0);
  const uint16_t d1 = to_half(static_cast<float>(f0.qw / std::max(f0.qq, 1.0)));
  fit(block, d1, f1);
  const bool better = f1.err < f0.err;
  const uint16_t d = better ? d1 : d0;
  const float* q = better ? f1.q : f0.q;
  for (int j = 0; j < kQ4 / 2; ++j)
    codes[j] = static_cast<uint8_t>((static_cast<int>(q[j]) + 8) | ((static_cast<int>(q[j + kQ4 / 2]) + 8) << 4));
  *scale = d;
  return static_cast<int>((d & 0x7C00u) == 0x7C00u ? EncodeStatus::ScaleOverflow : EncodeStatus::Ok);
}

template <typename T>
int encode_row(const T* row, int cols, uint8_t* codes, uint16_t* scales) {
  int status = static_cast<int>(EncodeStatus::Ok);
  float block[kQ4];
  for (int b = 0, c0 = 0; c0 < cols; ++b, c0 += kQ4) {
    const int len = std::min(kQ4, cols - c0);
    for (int k = 0; k < len; ++k) block[k] = widen(row + c0, k);
    std::fill(block + len, block + kQ4, 0.f);  // columns past the last whole block: zeros (code 8)
    status = std::max(status, encode_block(block, codes + b * kQ4Bytes, scales + b));
  }
  return status;
}

template <typename T>
EncodeStatus encode(const T* w, int64_t rows, int cols, uint8_t* codes, uint16_t* scales, int threads) {
  const int nb = (cols + kQ4 - 1) / kQ4;
  const Isa isa = best_isa();
  int status = static_cast<int>(EncodeStatus::Ok);
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : status)
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = w + r * cols;
    uint8_t* row_codes = codes + r * nb * kQ4Bytes;
    uint16_t* row_scales = scales + r * nb;
#if defined(MOSAIC_X86)
    const int row_status = isa == Isa::Avx512 ? detail::encode_q4_row_avx512(row, cols, row_codes, row_scales)
                           : isa == Isa::Avx2 ? detail::encode_q4_row_avx2(row, cols, row_codes, row_scales)
                                              : detail::encode_q4_row_scalar(row, cols, row_codes, row_scales);
#else
    const int row_status = detail::encode_q4_row_scalar(row, cols, row_codes, row_scales);
    (void)isa;
#endif
    status = std::max(status, row_status);
  }
  return static_cast<EncodeStatus>(status);
}

}  // namespace

int detail::encode_q4_row_scalar(const float* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

int detail::encode_q4_row_scalar(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales) {
  return encode_row(row, cols, codes, scales);
}

EncodeStatus encode_q4(EncodeInput w, uint8_t* codes, uint16_t* scales, int threads) {
  return w.bf16 ? encode(static_cast<const uint16_t*>(w.data), w.rows, w.cols, codes, scales, threads)
                : encode(static_cast<const float*>(w.data), w.rows, w.cols, codes, scales, threads);
}

}  // namespace mosaic
