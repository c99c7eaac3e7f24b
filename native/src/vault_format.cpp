// Record layout arithmetic, the C++ side of mosaic_runtime/vault/format.py::record_layout.
#include "mosaic/vault_format.h"

#include <stdexcept>

namespace mosaic {

uint32_t scale_itemsize(ScaleDtype d) { return d == ScaleDtype::F32 ? 4 : d == ScaleDtype::E8M0 ? 1 : 2; }

RecordLayout record_layout(QuantType quant, ScaleDtype scale_dtype, uint32_t hidden, uint32_t intermediate, bool bias) {
  if (quant == QuantType::Q4_G32 && scale_dtype != ScaleDtype::F16)
    throw std::invalid_argument("Q4_G32 scales are f16");
  if (quant == QuantType::MXFP4_G32 && scale_dtype != ScaleDtype::E8M0)
    throw std::invalid_argument("MXFP4_G32 scales are e8m0");
  if (quant == QuantType::FP8_B128 && scale_dtype != ScaleDtype::BF16 && scale_dtype != ScaleDtype::F32)
    throw std::invalid_argument("FP8_B128 scales are bf16 or f32");
  RecordLayout layout{};
  layout.quant = quant;
  layout.scale_dtype = scale_dtype;
  layout.bias = bias;
  uint64_t at = 0;
  for (Projection p : {Projection::Gate, Projection::Up, Projection::Down}) {
    // gate/up are [I, H], down is [H, I], as nn.Linear stores them.
    const uint64_t rows = p == Projection::Down ? hidden : intermediate;
    const uint64_t cols = p == Projection::Down ? intermediate : hidden;
    uint64_t code_rows, code_cols, scale_rows, scale_cols;
    if (quant == QuantType::Q4_G32 || quant == QuantType::MXFP4_G32) {  // both: 32 weights, 16 bytes a block
      const uint64_t blocks = (cols + kQ4Block - 1) / kQ4Block;
      code_rows = rows, code_cols = blocks * kQ4BlockBytes, scale_rows = rows, scale_cols = blocks;
    } else if (quant == QuantType::Q3_G32 || quant == QuantType::Q2_G32) {
      if (scale_dtype != ScaleDtype::F16) throw std::invalid_argument("Q3_G32 and Q2_G32 scales are f16");
      const uint64_t blocks = (cols + kQ4Block - 1) / kQ4Block;
      code_rows = rows, code_cols = blocks * (quant == QuantType::Q3_G32 ? kQ3BlockBytes : kQ2BlockBytes);
      scale_rows = rows, scale_cols = blocks;
    } else if (quant == QuantType::FP8_B128) {
      code_rows = rows, code_cols = cols;
      scale_rows = (rows + kFp8Block - 1) / kFp8Block, scale_cols = (cols + kFp8Block - 1) / kFp8Block;
    } else {
      throw std::invalid_argument("unknown quant type");
    }
    at = align_up(at, kPlaneAlign);
    layout.planes.push_back({p, PlaneKind::Codes, at, code_rows * code_cols, code_rows, code_cols});
    at += code_rows * code_cols;
    at = align_up(at, kPlaneAlign);
    const uint64_t sbytes = scale_rows * scale_cols * scale_itemsize(scale_dtype);
    layout.planes.push_back({p, PlaneKind::Scales, at, sbytes, scale_rows, scale_cols});
    at += sbytes;
  }
  if (bias) {
    for (Projection p : {Projection::Gate, Projection::Up, Projection::Down}) {
      const uint64_t rows = p == Projection::Down ? hidden : intermediate;
      at = align_up(at, kPlaneAlign);
      layout.planes.push_back({p, PlaneKind::Bias, at, rows * 4, 1, rows});
      at += rows * 4;
    }
  }
  layout.payload_bytes = at;
  layout.record_bytes = align_up(at, kPageSize);
  return layout;
}

}  // namespace mosaic
