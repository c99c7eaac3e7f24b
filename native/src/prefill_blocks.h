// How the prefill loops cut a prompt: the backbone rows (backbone_rows.h) into token blocks, the int8 expert
// loops (int8_avx2_loops.h, kernels_avx512.cpp, kernels_neon.cpp) into row panels, and their rows-in-lanes
// loops' row tiles into tile panels. Internal to native/src.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

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

// The next row tile's codes and scales, fetched a share a block while this tile is transposed: the transpose
// reads a tile's rows as 8 or 16 strided streams, which the hardware prefetcher did not keep ahead of, and a
// prefill's experts come from ring memory each once (a 512-token layer of 256 experts ran 1.5x slower on
// records spread over memory than on one record in cache, the same calls otherwise).
struct NextTile {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  size_t code_lines = 0, scale_lines = 0;
  int blocks = 1;

  // Rows [r, r + rows) of a matrix of `blocks` blocks a row (code_row and scale_row bytes each), none past
  // `total` rows.
  NextTile(const uint8_t* all_codes, const void* all_scales, size_t code_row, size_t scale_row, int r, int rows,
           int total, int blocks_per_row)
      : blocks(std::max(1, blocks_per_row)) {
    const int n = std::max(0, std::min(rows, total - r));
    if (n == 0) return;
    codes = all_codes + static_cast<uint64_t>(r) * code_row;
    scales = static_cast<const uint8_t*>(all_scales) + static_cast<uint64_t>(r) * scale_row;
    code_lines = (n * code_row + 63) / 64;
    scale_lines = (n * scale_row + 63) / 64;
  }

  // The lines to have fetched before block b (of blocks): the codes' first, then the scales'. The ISA file
  // issues each one's prefetch (GCC dropped them from a loop in a generic helper like this one).
  size_t lines_before(int b) const { return b * (code_lines + scale_lines) / blocks; }
  const char* line(size_t i) const {
    return reinterpret_cast<const char*>(i < code_lines ? codes + i * 64 : scales + (i - code_lines) * 64);
  }
};

}  // namespace mosaic::detail
