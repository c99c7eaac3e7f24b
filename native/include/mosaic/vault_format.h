// C++ mirror of the vault byte layout (vault_format.md). The Python twin is
// mosaic_runtime/vault/format.py; tests/test_native_format.py keeps the two equal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mosaic {

// --- constants (vault_format.md §2) -------------------------------------------------------------
inline constexpr char kVaultMagic[8] = {'M', 'O', 'S', 'A', 'I', 'C', 'V', '\0'};  // 8 bytes at 0
inline constexpr uint16_t kVersionMajor = 1;
inline constexpr uint16_t kVersionMinor = 4;
inline constexpr uint32_t kHeaderSize = 128;
inline constexpr uint32_t kPageSize = 16384;     // records start on and span whole 16 KiB pages
inline constexpr uint32_t kPlaneAlign = 64;      // planes inside a record start on a cache line
inline constexpr uint32_t kIndexEntrySize = 32;
inline constexpr uint32_t kQ4Block = 32;         // weights per f16 scale, along the input dim
inline constexpr uint32_t kQ4BlockBytes = 16;    // nibbles of one block
inline constexpr uint32_t kQ4Zero = 8;           // w = d * (q - 8)
inline constexpr uint32_t kFp8Block = 128;       // FP8 scales cover 128 x 128 tiles
inline constexpr uint32_t kMxfp4Block = 32;      // weights per E8M0 scale, along the input dim
inline constexpr uint32_t kMxfp4BlockBytes = 16; // E2M1 codes of one block, two a byte
inline constexpr uint32_t kE8m0Bias = 127;       // an E8M0 scale s is 2^(s - 127)
inline constexpr uint32_t kFlagExpertBias = 1;   // header flag: records end with float32 biases (§4.4)
inline constexpr uint32_t kFlagPerRecordQuant = 2;  // header flag: index entries name each record's type (§5.1)
inline constexpr uint32_t kQ3BlockBytes = 12;    // Q3_G32: 8 bytes of low bit pairs, 4 of third bits
inline constexpr uint32_t kQ3Zero = 4;           // w = d * (q - 4)
inline constexpr uint32_t kQ2BlockBytes = 8;     // Q2_G32: four 2-bit codes a byte
inline constexpr uint32_t kQ2Zero = 2;           // w = d * (q - 2)

// Q3_G32 and Q2_G32 are record types of a per-record Q4_G32 vault only: widened to Q4_G32 when read.
enum class QuantType : uint32_t { Q4_G32 = 1, FP8_B128 = 2, MXFP4_G32 = 3, Q3_G32 = 4, Q2_G32 = 5 };
enum class ScaleDtype : uint32_t { F16 = 1, BF16 = 2, F32 = 3, E8M0 = 4 };
enum class Projection : uint32_t { Gate = 0, Up = 1, Down = 2 };  // record order (§4)
enum class PlaneKind : uint32_t { Codes = 0, Scales = 1, Bias = 2 };

// --- fixed header (§3), little-endian, packed as written on disk --------------------------------
#pragma pack(push, 1)
struct VaultHeaderV1 {
  char magic[8];            // "MOSAICV\0"
  uint16_t version_major;   // 1
  uint16_t version_minor;   // 1
  uint32_t header_size;     // 128
  uint32_t page_size;       // 16384
  uint32_t quant_type;      // QuantType
  uint32_t scale_dtype;     // ScaleDtype
  uint32_t num_layers;      // all decoder layers, dense ones included
  uint32_t num_experts;     // routed experts per MoE layer
  uint32_t hidden_size;     // H
  uint32_t moe_intermediate_size;  // I
  uint32_t num_records;     // MoE layers x experts
  uint32_t record_bytes;    // every record, a multiple of page_size
  uint32_t flags;           // kFlagExpertBias or 0
  uint64_t arch_offset;     // = header_size
  uint64_t arch_length;
  uint64_t lineage_offset;  // = arch_offset + arch_length
  uint64_t lineage_length;
  uint64_t index_offset;    // 8-byte aligned, after the lineage block
  uint64_t index_length;    // num_records * 32
  uint64_t data_offset;     // first page boundary after the index
  uint64_t file_size;       // data_offset + num_records * record_bytes
  uint32_t meta_crc32;      // CRC-32 of [arch_offset, data_offset)
  uint32_t header_crc32;    // CRC-32 of bytes [0, 124)
};

struct IndexEntryV1 {
  uint32_t layer;
  uint32_t expert;
  uint64_t offset;   // absolute, page aligned
  uint64_t length;   // = record_bytes, or the record's own type's record size with kFlagPerRecordQuant
  uint32_t crc32;    // of the whole record as stored, padding included
  uint32_t quant;    // the record's QuantType with kFlagPerRecordQuant, else 0
};
#pragma pack(pop)
static_assert(sizeof(VaultHeaderV1) == kHeaderSize, "header is 128 bytes");
static_assert(sizeof(IndexEntryV1) == kIndexEntrySize, "index entry is 32 bytes");

// --- record layout (§4) -------------------------------------------------------------------------
struct Plane {
  Projection projection;
  PlaneKind kind;
  uint64_t offset;     // from the start of the record
  uint64_t nbytes;
  uint64_t rows, cols; // codes: [rows, bytes per row]; scales: [scale rows, scale cols]; bias: [1, rows]
};

struct RecordLayout {
  QuantType quant;
  ScaleDtype scale_dtype;
  bool bias;                  // kFlagExpertBias: planes 6-8 are the float32 biases of gate, up and down
  std::vector<Plane> planes;  // gate codes, gate scales, up codes, up scales, down codes, down scales[, biases]
  uint64_t payload_bytes;
  uint64_t record_bytes;
};

constexpr uint64_t align_up(uint64_t x, uint64_t n) { return (x + n - 1) / n * n; }
uint32_t scale_itemsize(ScaleDtype d);
RecordLayout record_layout(QuantType quant, ScaleDtype scale_dtype, uint32_t hidden, uint32_t intermediate,
                           bool bias = false);

// A Q3_G32 or Q2_G32 record, read into the first bytes of `buf`, rewritten in place as the Q4_G32 record of
// the same weights (codes q - zero + 8 under the same scales: exact). `buf` holds the Q4_G32 record_bytes.
// Plane by plane and row by row from the end, so every write lands at or past the bytes still to be read.
void widen_record(uint8_t* buf, QuantType stored, uint32_t hidden, uint32_t intermediate);

}  // namespace mosaic
