// Y[n, rows] = X[n, cols] @ W.T for a bf16 W, accumulating in float32: the backbone's projections.
// A bf16 value widens to float exactly (a 16-bit shift), so this is float arithmetic on the stored
// weights, as transformers computes with them, only without a float32 copy in memory. The rows' inner
// loops are per ISA (backbone_rows.h); this is the driver and the scalar reference.
#include "backbone_rows.h"
#include "mosaic/kernels.h"

namespace mosaic {
namespace detail {
namespace {

template <int NT>
void bf16_row(const uint16_t* w, int cols, const float* x, int ldx, float* y, int ldy) {
  for (int t = 0; t < NT; ++t) {
    float s = 0.f;
    for (int c = 0; c < cols; ++c) s += bf16_to_f32(w[c]) * x[t * ldx + c];
    y[t * ldy] = s;
  }
}

template <int NT, bool Fp8>
void code_row(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  for (int t = 0; t < NT; ++t) {
    float s = 0.f;
    for (int c = 0; c < cols; ++c)
      s += code_value<Fp8>(w[c]) * x[t * ldx + c];
    y[t * ldy] = scale * s;
  }
}

template <bool Fp8>
void code_rows(const uint8_t* w, int cols, const float* x, int ldx, int nt, float scale, float* y, int ldy) {
  for_tokens(nt, [&](auto NT) { code_row<decltype(NT)::value, Fp8>(w, cols, x, ldx, scale, y, ldy); });
}

}  // namespace

BackboneRows backbone_rows_scalar() {
  return {[](const uint16_t* w, int nrows, int cols, const float* x, int ldx, int nt, float* y, int ldy) {
            for (int i = 0; i < nrows; ++i)
              for_tokens(nt, [&](auto NT) { bf16_row<decltype(NT)::value>(w + i * cols, cols, x, ldx, y + i, ldy); });
          },
          code_rows<false>, code_rows<true>};
}

BackboneRows backbone_rows(Isa vector) {
  switch (vector) {
#if defined(MOSAIC_X86)
    case Isa::Avx512: return backbone_rows_avx512();
    case Isa::Avx2: return backbone_rows_avx2();
#elif defined(MOSAIC_ARM)
    case Isa::Neon: return backbone_rows_neon();
#endif
    default: return backbone_rows_scalar();
  }
}

}  // namespace detail

void linear_bf16(const uint16_t* w, int rows, int cols, const float* x, int n, float* y, int threads, Isa isa) {
  const detail::Bf16RowFn row = detail::backbone_rows(vector_isa(isa)).bf16;
  detail::for_row_tiles(rows, cols, n, threads, detail::kBf16Rows, [&](int r, int nr, int t0, int nt) {
    row(w + static_cast<uint64_t>(r) * cols, nr, cols, x + static_cast<uint64_t>(t0) * cols, cols, nt,
        y + static_cast<uint64_t>(t0) * rows + r, rows);
  });
}

}  // namespace mosaic
