// The CPU-specific half of crc32 (crc32.cpp). Internal to native/src.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mosaic::detail {

// Folds the longest prefix of p[0..n) that this CPU's CRC instructions take into the running (inverted)
// state c and returns its length: 0 where the CPU has none, and the table loop does the rest.
size_t crc32_accelerated(uint32_t& c, const uint8_t* p, size_t n);

}  // namespace mosaic::detail
