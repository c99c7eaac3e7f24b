// Low-bit records (Q3_G32, Q2_G32) widened to Q4_G32 where they land, by the ring's I/O threads: the disk
// holds fewer bytes, the kernels see the one layout they know. vault_format.md §4.5 gives the bit order;
// mosaic_runtime/vault/record.py::widen_record is the reference the tests hold this to.
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mosaic/vault_format.h"

namespace mosaic {
namespace {

// One block's 32 codes, unsigned, from its stored bytes.
inline void unpack_block(const uint8_t* src, bool three_bits, uint8_t u[32]) {
  for (int j = 0; j < 8; ++j) {
    const uint8_t b = src[j];
    u[j] = b & 3, u[j + 8] = (b >> 2) & 3, u[j + 16] = (b >> 4) & 3, u[j + 24] = b >> 6;
  }
  if (three_bits)
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 8; ++i) u[j + 4 * i] |= ((src[8 + j] >> i) & 1) << 2;
}

}  // namespace

void widen_record(uint8_t* buf, QuantType stored, uint32_t hidden, uint32_t intermediate) {
  if (stored != QuantType::Q3_G32 && stored != QuantType::Q2_G32)
    throw std::invalid_argument("widen_record: only Q3_G32 and Q2_G32 records widen");
  const bool three = stored == QuantType::Q3_G32;
  const uint32_t src_block = three ? kQ3BlockBytes : kQ2BlockBytes;
  const uint8_t shift = static_cast<uint8_t>(kQ4Zero - (three ? kQ3Zero : kQ2Zero));
  const RecordLayout from = record_layout(stored, ScaleDtype::F16, hidden, intermediate);
  const RecordLayout to = record_layout(QuantType::Q4_G32, ScaleDtype::F16, hidden, intermediate);
  // Every Q4_G32 plane starts at or past its stored twin (each plane is as large or larger, and earlier
  // ones too), so going from the last plane back, and from a plane's last row back, never overwrites a
  // byte before it is read; a row is unpacked whole before its wider form is written.
  std::vector<uint8_t> row;
  for (size_t p = from.planes.size(); p-- > 0;) {
    const Plane& s = from.planes[p];
    const Plane& d = to.planes[p];
    if (s.kind == PlaneKind::Scales) {
      std::memmove(buf + d.offset, buf + s.offset, s.nbytes);
      continue;
    }
    const uint64_t blocks = s.cols / src_block;
    row.resize(s.cols);
    for (uint64_t r = s.rows; r-- > 0;) {
      std::memcpy(row.data(), buf + s.offset + r * s.cols, s.cols);
      uint8_t* out = buf + d.offset + r * d.cols;
      for (uint64_t b = 0; b < blocks; ++b) {
        uint8_t u[32];
        unpack_block(row.data() + b * src_block, three, u);
        for (int j = 0; j < 16; ++j)
          out[b * kQ4BlockBytes + j] = static_cast<uint8_t>((u[j] + shift) | ((u[j + 16] + shift) << 4));
      }
    }
  }
}

}  // namespace mosaic
