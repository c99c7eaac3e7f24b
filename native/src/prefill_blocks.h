// How the prefill loops cut a prompt: the backbone rows (backbone_rows.h) into token blocks, the int8 expert
// loops (int8_avx2_loops.h, kernels_avx512.cpp, kernels_neon.cpp) into row panels. Internal to native/src.
#pragma once

#include <algorithm>
#include <cstddef>

namespace mosaic::detail {

// Tokens a prefill's row pass takes at once: as many as keep their activations (bytes_per_token each) within
// 128 KB of L2, and a whole number of the loop's token tile; every row runs against one block before the next.
inline int prefill_token_block(size_t bytes_per_token, int tile) {
  constexpr size_t kBlockBytes = 128 << 10;
  return std::max(tile, static_cast<int>(kBlockBytes / bytes_per_token) / tile * tile);
}

// Rows a prefill's int8 pass takes as one panel: as many as keep their codes (row_bytes each) within 64 KB
// of L2. Every token tile runs over the whole panel before the next tile, so a tile's quantised activations
// (a few KB) stay in L1 while the panel's rows stream past them from L2, and each panel reads all the tokens'
// activations once. Rows outside, token tiles inside: a row against every token in turn had re-read 512
// tokens' activations (a megabyte) from L2 for each row, and the loads of activations, not the arithmetic,
// had set the pace.
inline int prefill_row_panel(size_t row_bytes) {
  constexpr size_t kPanelBytes = 64 << 10;
  return std::max(1, static_cast<int>(kPanelBytes / std::max<size_t>(row_bytes, 1)));
}

}  // namespace mosaic::detail
