// How the prefill loops cut a prompt: the backbone rows (backbone_rows.h) into token blocks, the int8 expert
// loops (int8_avx2_loops.h, kernels_avx512.cpp, kernels_neon.cpp) into row panels, and their rows-in-lanes
// loops' row tiles into tile panels. Internal to native/src.
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

// Row tiles a rows-in-lanes prefill takes as one panel, against activations of x_bytes in the loop's layout.
// Where those fit in 256 KB of L2, one: each tile stays in L1 while every token group passes it. Past that,
// as many as keep their transposed codes (tile_bytes each) within those 256 KB, and every token group runs
// over the whole panel before the next group: a tile against every group in turn re-read a 512-token
// prompt's activations (one to two megabytes) for each tile of 8 or 16 rows. (`linear_q4` of 512 tokens on
// the Xeon without AMX, the builds alternated: 1.01-1.2x; at 32 tokens panels ran 0.87-1.04x.)
inline int prefill_tile_panel(size_t tile_bytes, size_t x_bytes) {
  constexpr size_t kPanelBytes = 256 << 10;
  if (x_bytes <= kPanelBytes) return 1;
  return std::max(1, static_cast<int>(kPanelBytes / std::max<size_t>(tile_bytes, 1)));
}

}  // namespace mosaic::detail
