// One row of the Q4_G32 encoder, the unit its ISA paths share (encode_q4.cpp, encode_q4_avx2.cpp,
// encode_q4_avx512.cpp).
#pragma once

#include <cstdint>

namespace mosaic::detail {

// The code bytes [ceil(cols/32) * 16] and f16 scales (bits) [ceil(cols/32)] of one row of float32 or bf16
// (bit patterns) weights; returns the worst EncodeStatus of its blocks as int. Every path writes the same
// bytes: the float32 steps are the same operations elementwise, and the float64 sums are exact, so their
// order does not matter.
int encode_q4_row_scalar(const float* row, int cols, uint8_t* codes, uint16_t* scales);
int encode_q4_row_scalar(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales);
int encode_q4_row_avx2(const float* row, int cols, uint8_t* codes, uint16_t* scales);
int encode_q4_row_avx2(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales);
int encode_q4_row_avx512(const float* row, int cols, uint8_t* codes, uint16_t* scales);
int encode_q4_row_avx512(const uint16_t* row, int cols, uint8_t* codes, uint16_t* scales);

}  // namespace mosaic::detail
