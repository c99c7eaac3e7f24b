// CRC-32 (zlib / IEEE 802.3, reflected 0xEDB88320), as vault_format.md §2 defines it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mosaic {

// crc32(0, data, n) == zlib.crc32(data); pass a previous result to continue a running CRC.
uint32_t crc32(uint32_t crc, const uint8_t* data, size_t n);

}  // namespace mosaic
