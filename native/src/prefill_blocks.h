// How the int8 loops (kernels_avx2.cpp, kernels_avx512.cpp) cut a prefill's tokens. Internal to native/src.
#pragma once

#include <algorithm>
#include <cstddef>

namespace mosaic::detail {

// Tokens a prefill's int8 row pass takes at once: as many as keep their quantised activations
// (bytes_per_token each) within 128 KB of L2, since each row's pass reads all of a block's (512 tokens' are a
// megabyte), and a whole number of the loop's token tile; every row runs against one block before the next.
inline int prefill_token_block(size_t bytes_per_token, int tile) {
  constexpr size_t kBlockBytes = 128 << 10;
  return std::max(tile, static_cast<int>(kBlockBytes / bytes_per_token) / tile * tile);
}

}  // namespace mosaic::detail
