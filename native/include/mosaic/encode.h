// Native encoders for the vault's block types, byte for byte what the torch references in
// mosaic_runtime/vault/quant.py write (tests/test_quant.py holds them together): the converter and the
// backbone quantised at load run these where the extension is built.
#pragma once

#include <cstdint>

namespace mosaic {

enum class EncodeStatus : int { Ok = 0, NotFinite = 1, ScaleOverflow = 2 };

// Weights [rows, cols], row-major: float32, or bf16 as their bit patterns, widened as they are read (no
// float32 copy of the matrix is made).
struct EncodeInput {
  const void* data;
  bool bf16;
  int64_t rows;
  int cols;
};

// Q4_G32 of w: codes [rows, ceil(cols/32) * 16] (byte j of block b holds
// element 32b + j in its low nibble and 32b + j + 16 in its high one) and f16 scales [rows, ceil(cols/32)]
// as bit patterns. Each block starts from llama.cpp's Q4_0 scale (its weight of largest magnitude maps to
// -8), refits it by least squares for those codes and keeps whichever has the smaller error; columns past
// the last whole block are zeros (code 8). NotFinite: a weight is inf or nan; ScaleOverflow: a scale
// exceeds f16. Either way nothing written is meaningful.
EncodeStatus encode_q4(EncodeInput w, uint8_t* codes, uint16_t* scales, int threads);

// FP8_B128 of w: E4M3FN codes [rows, cols] and float32 scales
// [ceil(rows/128), ceil(cols/128)], one per 128 x 128 tile: amax / 448 (1 for an all-zero tile), each weight
// divided by its tile's scale, clamped to +-448, rounded to nearest with ties to even. NotFinite: a weight is
// inf or nan (its tile's codes and scale are not written).
EncodeStatus encode_fp8(EncodeInput w, uint8_t* codes, float* scales, int threads);

}  // namespace mosaic
