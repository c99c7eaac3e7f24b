// The backbone projections' inner loop, one weight row against up to kRowTokens tokens, per ISA: the
// drivers (linear_bf16.cpp, linear_quant.cpp) split rows over threads and call the row function of the
// ISA they were given. Internal to native/src.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mosaic/kernels.h"

namespace mosaic::detail {

inline constexpr int kRowTokens = 4;  // tokens a row call serves: each weight load feeds them all

// y[t * ldy] = sum_c w[c] * x[t * ldx + c] for t < nt (1..kRowTokens), w bf16.
using Bf16RowFn = void (*)(const uint16_t* w, int cols, const float* x, int ldx, int nt, float* y, int ldy);
// y[t * ldy] = scale * sum_c code(w[c]) * x[t * ldx + c], codes int8 or E4M3.
using CodeRowFn = void (*)(const uint8_t* w, int cols, const float* x, int ldx, int nt, float scale, float* y,
                           int ldy);

// One code's value: an int8, or an E4M3 byte (the scalar arithmetic of every ISA's row tails).
template <bool Fp8>
inline float code_value(uint8_t b) {
  return Fp8 ? e4m3_to_f32(b) : static_cast<float>(static_cast<int8_t>(b));
}

struct BackboneRows {
  Bf16RowFn bf16;
  CodeRowFn int8;
  CodeRowFn fp8;
};

BackboneRows backbone_rows_scalar();
BackboneRows backbone_rows_avx2();
BackboneRows backbone_rows_avx512();
BackboneRows backbone_rows_neon();
BackboneRows backbone_rows(Isa vector);  // a float ISA of this build

// f(std::integral_constant<int, nt>{}) for nt in 1..kRowTokens: how each ISA file turns its rows, templated
// on their token count, into a row function.
template <typename F>
inline void for_tokens(int nt, F&& f) {
  switch (nt) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

}  // namespace mosaic::detail
