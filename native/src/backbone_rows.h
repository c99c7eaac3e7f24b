// The backbone projections' inner loop, one weight row against up to kRowTokens tokens, per ISA: the
// drivers (linear_bf16.cpp, linear_quant.cpp) split rows over threads and call the row function of the
// ISA they were given. Internal to native/src.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "mosaic/kernels.h"

#include "prefill_blocks.h"

namespace mosaic::detail {

inline constexpr int kRowTokens = 4;  // tokens a row call serves: each weight load feeds them all
inline constexpr int kBf16Rows = 4;   // bf16 rows a call may take: each activation load feeds them all

// y[t * ldy + i] = sum_c w[i * cols + c] * x[t * ldx + c] for i < nrows (1..kBf16Rows) and t < nt
// (1..kRowTokens), w bf16. Each (row, token) sum is computed alike whatever nrows and nt.
using Bf16RowFn = void (*)(const uint16_t* w, int nrows, int cols, const float* x, int ldx, int nt, float* y,
                           int ldy);
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

// f(r, nr, t0, nt) for every group of nr <= row_group rows from r (groups start at multiples of row_group)
// and every tile of nt <= kRowTokens tokens from t0, the rows split over threads. A prompt's tokens go in
// blocks whose activations (cols floats a token) stay in L2, each block through every row before the next:
// row by row over all tokens re-read a 512-token prompt's 4 MB of activations from memory for every row (a
// router's bf16 rows ran at 17 GMAC/s on two threads). The tiles are the same as without blocks, so the
// sums are too.
template <typename F>
inline void for_row_tiles(int rows, int cols, int n, int threads, int row_group, F&& f) {
  const int block = prefill_token_block(static_cast<size_t>(cols) * sizeof(float), kRowTokens);
  const int groups = (rows + row_group - 1) / row_group;
  // One parallel region, each thread its share of the rows through every block: a region (a fork and a
  // join) a block cost more than a small matrix's arithmetic (a shared expert's one-row gate, 1.4 ms for
  // 512 tokens).
#pragma omp parallel num_threads(threads)
  {
    const int nth = omp_get_num_threads(), me = omp_get_thread_num();
    const int g0 = static_cast<int>(static_cast<int64_t>(groups) * me / nth);
    const int g1 = static_cast<int>(static_cast<int64_t>(groups) * (me + 1) / nth);
    for (int b0 = 0; b0 < n; b0 += block) {
      const int b1 = std::min(n, b0 + block);
      for (int g = g0; g < g1; ++g) {
        const int r = g * row_group, nr = std::min(row_group, rows - r);
        for (int t0 = b0; t0 < b1; t0 += kRowTokens) f(r, nr, t0, std::min(kRowTokens, b1 - t0));
      }
    }
  }
}

}  // namespace mosaic::detail
