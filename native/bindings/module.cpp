// nanobind glue only: every function here calls into the Python-free core in native/src.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <string>
#include <tuple>
#include <vector>

#include "mosaic/vault_format.h"

namespace nb = nanobind;
using namespace mosaic;

namespace {

const char* projection_name(Projection p) {
  switch (p) {
    case Projection::Gate: return "gate";
    case Projection::Up: return "up";
    default: return "down";
  }
}

void init_format(nb::module_& m) {
  nb::module_ f = m.def_submodule("format", "C++ mirror of the vault layout constants");
  f.attr("VAULT_MAGIC") = nb::bytes(kVaultMagic, sizeof(kVaultMagic));
  f.attr("VERSION_MAJOR") = kVersionMajor;
  f.attr("VERSION_MINOR") = kVersionMinor;
  f.attr("HEADER_SIZE") = kHeaderSize;
  f.attr("PAGE_SIZE") = kPageSize;
  f.attr("PLANE_ALIGN") = kPlaneAlign;
  f.attr("INDEX_ENTRY_SIZE") = kIndexEntrySize;
  f.attr("Q4_BLOCK") = kQ4Block;
  f.attr("Q4_BLOCK_BYTES") = kQ4BlockBytes;
  f.attr("Q4_ZERO") = kQ4Zero;
  f.attr("FP8_BLOCK") = kFp8Block;
  f.def("header_field_offsets", [] {
    // (name, offset, size) of every fixed-header field, for the parity test.
    std::vector<std::tuple<std::string, size_t, size_t>> out;
#define MOSAIC_FIELD(name) out.emplace_back(#name, offsetof(VaultHeaderV1, name), sizeof(VaultHeaderV1::name))
    MOSAIC_FIELD(magic); MOSAIC_FIELD(version_major); MOSAIC_FIELD(version_minor); MOSAIC_FIELD(header_size);
    MOSAIC_FIELD(page_size); MOSAIC_FIELD(quant_type); MOSAIC_FIELD(scale_dtype); MOSAIC_FIELD(num_layers);
    MOSAIC_FIELD(num_experts); MOSAIC_FIELD(hidden_size); MOSAIC_FIELD(moe_intermediate_size);
    MOSAIC_FIELD(num_records); MOSAIC_FIELD(record_bytes); MOSAIC_FIELD(flags); MOSAIC_FIELD(arch_offset);
    MOSAIC_FIELD(arch_length); MOSAIC_FIELD(lineage_offset); MOSAIC_FIELD(lineage_length);
    MOSAIC_FIELD(index_offset); MOSAIC_FIELD(index_length); MOSAIC_FIELD(data_offset); MOSAIC_FIELD(file_size);
    MOSAIC_FIELD(meta_crc32); MOSAIC_FIELD(header_crc32);
#undef MOSAIC_FIELD
    return out;
  });
  f.def("record_layout", [](uint32_t quant, uint32_t scale_dtype, uint32_t hidden, uint32_t intermediate) {
    // ([(projection, kind, offset, nbytes, rows, cols)], payload_bytes, record_bytes)
    RecordLayout l = record_layout(QuantType(quant), ScaleDtype(scale_dtype), hidden, intermediate);
    std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, uint64_t, uint64_t>> planes;
    for (const Plane& p : l.planes)
      planes.emplace_back(projection_name(p.projection), p.is_scales ? "scales" : "codes", p.offset, p.nbytes,
                          p.rows, p.cols);
    return std::make_tuple(planes, l.payload_bytes, l.record_bytes);
  });
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Mosaic native core (format mirror; reader, ring and kernels arrive with the runtime)";
  init_format(m);
}
