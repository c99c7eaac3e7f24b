// nanobind glue only: every function here calls into the Python-free core in native/src.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mosaic/crc32.h"
#include "mosaic/decode.h"
#include "mosaic/encode.h"
#include "mosaic/expert_ring.h"
#include "mosaic/kernels.h"
#include "mosaic/vault_format.h"

namespace nb = nanobind;
using namespace mosaic;

void init_decode(nb::module_& m);  // decode_bindings.cpp

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
  f.attr("MXFP4_BLOCK") = kMxfp4Block;
  f.attr("MXFP4_BLOCK_BYTES") = kMxfp4BlockBytes;
  f.attr("E8M0_BIAS") = kE8m0Bias;
  f.attr("FLAG_EXPERT_BIAS") = kFlagExpertBias;
  f.attr("FLAG_PER_RECORD_QUANT") = kFlagPerRecordQuant;
  f.attr("Q3_BLOCK_BYTES") = kQ3BlockBytes;
  f.attr("Q3_ZERO") = kQ3Zero;
  f.attr("Q2_BLOCK_BYTES") = kQ2BlockBytes;
  f.attr("Q2_ZERO") = kQ2Zero;
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
  f.def("record_layout", [](uint32_t quant, uint32_t scale_dtype, uint32_t hidden, uint32_t intermediate, bool bias) {
    // ([(projection, kind, offset, nbytes, rows, cols)], payload_bytes, record_bytes)
    RecordLayout l = record_layout(QuantType(quant), ScaleDtype(scale_dtype), hidden, intermediate, bias);
    std::vector<std::tuple<std::string, std::string, uint64_t, uint64_t, uint64_t, uint64_t>> planes;
    static const char* kinds[] = {"codes", "scales", "bias"};
    for (const Plane& p : l.planes)
      planes.emplace_back(projection_name(p.projection), kinds[static_cast<int>(p.kind)], p.offset, p.nbytes,
                          p.rows, p.cols);
    return std::make_tuple(planes, l.payload_bytes, l.record_bytes);
  });
}

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Ints = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Matrix = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using OutMatrix = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Scratch = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void check(bool ok, const std::string& what) {
  if (!ok) throw nb::value_error(what.c_str());
}

using Weights2d = nb::ndarray<nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// An encoder's weights: float32, or bf16 as their uint16 bit patterns.
EncodeInput encode_input(const Weights2d& w, const char* encoder) {
  const bool bf16 = w.dtype() == nb::dtype<uint16_t>();
  check(bf16 || w.dtype() == nb::dtype<float>(), std::string(encoder) + ": weights are float32 or bf16 bits (uint16)");
  return {w.data(), bf16, static_cast<int64_t>(w.shape(0)), static_cast<int>(w.shape(1))};
}


// The tasks of one moe call, checked against x, y and scratch; kept across calls (no allocation per token).
std::vector<ExpertTask>& build_tasks(const RecordLayout& layout, int isa, int threads, const std::vector<Ints>& tokens,
                                     const std::vector<Floats1>& weights, const Matrix& x, const OutMatrix& y,
                                     const Scratch& scratch) {
  const size_t n = tokens.size();
  const size_t hidden = layout.planes[4].rows;
  check(weights.size() == n, "moe_experts: one weight list per token list");
  check(x.shape(1) == hidden && y.shape(1) == hidden && x.shape(0) == y.shape(0), "moe_experts: x/y shape");
  check(isa_available(Isa(isa)), "moe_experts: this CPU lacks that ISA");
  thread_local std::vector<ExpertTask> tasks;
  tasks.clear();
  int total = 0, max_n = 0;
  for (size_t i = 0; i < n; ++i) {
    check(tokens[i].shape(0) == weights[i].shape(0), "moe_experts: tokens and weights differ in length");
    const int cnt = static_cast<int>(tokens[i].shape(0));
    for (int j = 0; j < cnt; ++j)
      check(tokens[i].data()[j] >= 0 && static_cast<size_t>(tokens[i].data()[j]) < x.shape(0),
            "moe_experts: token index out of range");
    tasks.push_back({nullptr, tokens[i].data(), weights[i].data(), cnt});
    total += cnt;
    max_n = cnt > max_n ? cnt : max_n;
  }
  check(scratch.shape(0) >= moe_scratch_floats(layout, total, max_n, threads), "moe_experts: scratch too small");
  return tasks;
}

void init_kernels(nb::module_& m) {
  nb::module_ k = m.def_submodule("kernels", "Expert FFN kernels (scalar reference, AVX2, AVX-512)");
  k.attr("SCALAR") = static_cast<int>(Isa::Scalar);
  k.attr("AVX2") = static_cast<int>(Isa::Avx2);
  k.attr("AVX512") = static_cast<int>(Isa::Avx512);
  k.attr("AVX512_VNNI") = static_cast<int>(Isa::Avx512Vnni);
  k.attr("AVX2_INT8") = static_cast<int>(Isa::Avx2Int8);
  k.attr("AVX_VNNI") = static_cast<int>(Isa::AvxVnni);
  k.attr("AMX") = static_cast<int>(Isa::Amx);
  k.attr("NEON") = static_cast<int>(Isa::Neon);
  k.attr("NEON_DOT") = static_cast<int>(Isa::NeonDot);
  k.attr("NEON_I8MM") = static_cast<int>(Isa::NeonI8mm);
  k.def("isa_available", [](int isa) { return isa_available(Isa(isa)); });
  k.def("best_isa", [] { return static_cast<int>(best_isa()); });
  k.def("int8_isa", []() -> std::optional<int> {
    const Isa isa = int8_isa();
    if (isa == Isa::Scalar) return std::nullopt;
    return static_cast<int>(isa);
  }, "the int8-activation ISA of this CPU (AMX, AVX512_VNNI, AVX_VNNI, AVX2_INT8, NEON_I8MM or NEON_DOT), or None");
  k.def("isa_name", [](int isa) { return std::string(isa_name(Isa(isa))); });
  k.def("matvec",
        [](int isa, uint32_t quant, uint32_t scale_dtype, Bytes codes, Bytes scales, int rows, int cols, Matrix x,
           OutMatrix y) {
          // Y[n, rows] = X[n, cols] @ W.T for one quantised projection (tests and benchmarks).
          check(x.shape(1) == static_cast<size_t>(cols) && y.shape(1) == static_cast<size_t>(rows) &&
                    x.shape(0) == y.shape(0), "matvec: shapes disagree");
          check(isa_available(Isa(isa)), "matvec: this CPU lacks that ISA");
          const IsaKernels ks = kernels_for(Isa(isa));
          MatvecArgs a{codes.data(), scales.data(), ScaleDtype(scale_dtype), rows, cols, x.data(), cols,
                       static_cast<int>(x.shape(0)), y.data(), rows};
          nb::gil_scoped_release release;
          ks.of(QuantType(quant))(a);
        });
  k.def("linear_bf16", [](int isa, int threads, nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
                          Matrix x, OutMatrix y) {
    // y[n, rows] = x[n, cols] @ w.T, w the bf16 bit patterns (viewed as uint16).
    check(x.shape(1) == w.shape(1) && y.shape(1) == w.shape(0) && x.shape(0) == y.shape(0), "linear_bf16: shapes");
    check(isa_available(Isa(isa)), "linear_bf16: this CPU lacks that ISA");
    nb::gil_scoped_release release;
    linear_bf16(w.data(), static_cast<int>(w.shape(0)), static_cast<int>(w.shape(1)), x.data(),
                static_cast<int>(x.shape(0)), y.data(), threads, Isa(isa));
  });
  k.def("rms_norm_rows", [](int threads, Matrix x, Floats1 w, float eps, OutMatrix y) {
    // y[r] = w * x[r] / rms(x[r]) for each row (the decode step's norm: the sum of squares in double).
    check(x.shape(1) == w.shape(0) && y.shape(0) == x.shape(0) && y.shape(1) == x.shape(1), "rms_norm_rows: shapes");
    nb::gil_scoped_release release;
    rms_norm_rows(x.data(), w.data(), static_cast<int64_t>(x.shape(0)), static_cast<int>(x.shape(1)), eps, y.data(),
                  threads);
  });
  k.def("linear_quant", [](int isa, int threads, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
                           Floats1 scales, bool fp8, Matrix x, OutMatrix y) {
    // y[n, rows] = x[n, cols] @ (w * scales[:, None]).T, w int8 (or E4M3 when fp8) codes as uint8.
    check(x.shape(1) == w.shape(1) && y.shape(1) == w.shape(0) && x.shape(0) == y.shape(0) &&
              scales.shape(0) == w.shape(0), "linear_quant: shapes");
    check(isa_available(Isa(isa)), "linear_quant: this CPU lacks that ISA");
    nb::gil_scoped_release release;
    linear_quant(w.data(), scales.data(), fp8, static_cast<int>(w.shape(0)), static_cast<int>(w.shape(1)), x.data(),
                 static_cast<int>(x.shape(0)), y.data(), threads, Isa(isa));
  });
  // q, out [heads, head_dim]; k, v [kv_heads, length, head_dim] with contiguous rows (any head stride),
  // float32 or bf16 (as uint16 bit patterns); sinks [heads] or None.
  auto sinks_of = [](const std::optional<Floats1>& sinks, size_t heads) -> const float* {
    if (!sinks) return nullptr;
    check(sinks->shape(0) == heads, "decode_attention: one sink a query head");
    return sinks->data();
  };
  auto attention = [sinks_of](auto fn, int isa, int threads, Matrix q, auto k, auto v, float scale, OutMatrix out,
                              const std::optional<Floats1>& sinks) {
    const int64_t d = q.shape(1);
    check(k.shape(2) == static_cast<size_t>(d) && v.shape(2) == static_cast<size_t>(d) &&
              k.shape(0) == v.shape(0) && k.shape(1) == v.shape(1) && out.shape(0) == q.shape(0) &&
              out.shape(1) == q.shape(1) && k.shape(0) > 0 && q.shape(0) % k.shape(0) == 0 && k.shape(1) > 0,
          "decode_attention: shapes");
    check(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
          "decode_attention: K and V rows must be contiguous");
    check(isa_available(Isa(isa)), "decode_attention: this CPU lacks that ISA");
    const float* s = sinks_of(sinks, q.shape(0));
    nb::gil_scoped_release release;
    fn(q.data(), static_cast<int>(q.shape(0)), static_cast<int>(d), k.data(), v.data(), k.stride(0), v.stride(0),
       static_cast<int>(k.shape(0)), static_cast<int>(k.shape(1)), scale, out.data(), threads, Isa(isa), s);
  };
  using F32Cache = nb::ndarray<const float, nb::ndim<3>, nb::device::cpu>;
  using Bf16Cache = nb::ndarray<const uint16_t, nb::ndim<3>, nb::device::cpu>;
  k.def("decode_attention", [attention](int isa, int threads, Matrix q, F32Cache k, F32Cache v, float scale,
                                        OutMatrix out, std::optional<Floats1> sinks) {
    attention(decode_attention, isa, threads, q, k, v, scale, out, sinks);
  }, nb::arg("isa"), nb::arg("threads"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("out"),
     nb::arg("sinks") = nb::none());
  k.def("decode_attention_bf16", [attention](int isa, int threads, Matrix q, Bf16Cache k, Bf16Cache v, float scale,
                                             OutMatrix out, std::optional<Floats1> sinks) {
    attention(decode_attention_bf16, isa, threads, q, k, v, scale, out, sinks);
  }, nb::arg("isa"), nb::arg("threads"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("out"),
     nb::arg("sinks") = nb::none());
  using I8Cache = nb::ndarray<const int8_t, nb::ndim<3>, nb::device::cpu>;
  using RowScales = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>;
  // int8 codes, and a float32 scale per row: k_scale, v_scale [kv_heads, length], contiguous along length.
  k.def("decode_attention_i8", [sinks_of](int isa, int threads, Matrix q, I8Cache k, I8Cache v, RowScales k_scale,
                                          RowScales v_scale, float scale, OutMatrix out, std::optional<Floats1> sinks) {
    const int64_t d = q.shape(1);
    check(k.shape(2) == static_cast<size_t>(d) && v.shape(2) == static_cast<size_t>(d) &&
              k.shape(0) == v.shape(0) && k.shape(1) == v.shape(1) && out.shape(0) == q.shape(0) &&
              out.shape(1) == q.shape(1) && k.shape(0) > 0 && q.shape(0) % k.shape(0) == 0 && k.shape(1) > 0 &&
              k_scale.shape(0) == k.shape(0) && k_scale.shape(1) == k.shape(1) && v_scale.shape(0) == k.shape(0) &&
              v_scale.shape(1) == k.shape(1),
          "decode_attention: shapes");
    check(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
          "decode_attention: K and V rows must be contiguous");
    check(k_scale.stride(1) == 1 && v_scale.stride(1) == 1 && k_scale.stride(0) == v_scale.stride(0),
          "decode_attention: scales must be contiguous along the length, both with one head stride");
    check(isa_available(Isa(isa)), "decode_attention: this CPU lacks that ISA");
    const float* s = sinks_of(sinks, q.shape(0));
    nb::gil_scoped_release release;
    decode_attention_i8(q.data(), static_cast<int>(q.shape(0)), static_cast<int>(d), k.data(), v.data(), k.stride(0),
                        v.stride(0), k_scale.data(), v_scale.data(), k_scale.stride(0), static_cast<int>(k.shape(0)),
                        static_cast<int>(k.shape(1)), scale, out.data(), threads, Isa(isa), s);
  }, nb::arg("isa"), nb::arg("threads"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("k_scale"),
     nb::arg("v_scale"), nb::arg("scale"), nb::arg("out"), nb::arg("sinks") = nb::none());
  // q [t, heads, head_dim] at positions start..start+t-1, k and v [kv_heads, >= start+t, head_dim] as for
  // decode_attention (int8: with k_scale and v_scale [kv_heads, >= start+t]), out [t, heads * head_dim].
  using Queries = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
  auto check_prompt = [](int isa, const Queries& q, const auto& k, const auto& v, int start, const OutMatrix& out) {
    const size_t t = q.shape(0), heads = q.shape(1), d = q.shape(2);
    check(start >= 0 && t > 0 && k.shape(2) == d && v.shape(2) == d && k.shape(0) == v.shape(0) && k.shape(0) > 0 &&
              heads % k.shape(0) == 0 && k.shape(1) == v.shape(1) && k.shape(1) >= start + t &&
              out.shape(0) == t && out.shape(1) == heads * d, "prefill_attention: shapes");
    check(k.stride(2) == 1 && k.stride(1) == static_cast<int64_t>(d) && v.stride(2) == 1 &&
              v.stride(1) == static_cast<int64_t>(d), "prefill_attention: K and V rows must be contiguous");
    check(isa_available(Isa(isa)), "prefill_attention: this CPU lacks that ISA");
  };
  auto prompt = [check_prompt](auto fn, int isa, int threads, Queries q, auto k, auto v, int start, float scale,
                               OutMatrix out) {
    check_prompt(isa, q, k, v, start, out);
    nb::gil_scoped_release release;
    fn(q.data(), static_cast<int>(q.shape(0)), static_cast<int>(q.shape(1)), static_cast<int>(q.shape(2)), k.data(),
       v.data(), k.stride(0), v.stride(0), static_cast<int>(k.shape(0)), start, scale, out.data(), threads, Isa(isa));
  };
  k.def("prefill_attention", [prompt](int isa, int threads, Queries q, F32Cache k, F32Cache v, int start, float scale,
                                      OutMatrix out) {
    prompt(prefill_attention, isa, threads, q, k, v, start, scale, out);
  });
  k.def("prefill_attention_bf16", [prompt](int isa, int threads, Queries q, Bf16Cache k, Bf16Cache v, int start,
                                           float scale, OutMatrix out) {
    prompt(prefill_attention_bf16, isa, threads, q, k, v, start, scale, out);
  });
  k.def("prefill_attention_i8", [check_prompt](int isa, int threads, Queries q, I8Cache k, I8Cache v,
                                               RowScales k_scale, RowScales v_scale, int start, float scale,
                                               OutMatrix out) {
    check_prompt(isa, q, k, v, start, out);
    check(k_scale.shape(0) == k.shape(0) && k_scale.shape(1) >= k.shape(1) && v_scale.shape(0) == k.shape(0) &&
              v_scale.shape(1) >= k.shape(1) && k_scale.stride(1) == 1 && v_scale.stride(1) == 1 &&
              k_scale.stride(0) == v_scale.stride(0),
          "prefill_attention: scales must be [kv_heads, length], contiguous along the length, one head stride");
    nb::gil_scoped_release release;
    prefill_attention_i8(q.data(), static_cast<int>(q.shape(0)), static_cast<int>(q.shape(1)),
                         static_cast<int>(q.shape(2)), k.data(), v.data(), k.stride(0), v.stride(0), k_scale.data(),
                         v_scale.data(), k_scale.stride(0), static_cast<int>(k.shape(0)), start, scale, out.data(),
                         threads, Isa(isa));
  });
  k.def("linear_q4", [](int isa, int threads, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> codes,
                        nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> scales, Matrix x,
                        OutMatrix y) {
    // y[n, rows] = x[n, cols] @ W.T, W in Q4_G32: codes [rows, ceil(cols/32)*16], f16 scales (as uint16).
    const size_t cols = x.shape(1), blocks = (cols + 31) / 32;
    check(codes.shape(0) == y.shape(1) && codes.shape(1) == blocks * 16 && scales.shape(0) == codes.shape(0) &&
              scales.shape(1) == blocks && x.shape(0) == y.shape(0), "linear_q4: shapes");
    check(isa_available(Isa(isa)), "linear_q4: this CPU lacks that ISA");
    nb::gil_scoped_release release;
    linear_q4(codes.data(), scales.data(), static_cast<int>(codes.shape(0)), static_cast<int>(cols), x.data(),
              static_cast<int>(x.shape(0)), y.data(), threads, Isa(isa));
  });
  k.def("gated_delta_rule", [](int isa, int threads, nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> q,
                               nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu> k,
                               nb::ndarray<const float, nb::ndim<3>, nb::device::cpu> v, Matrix g, Matrix beta,
                               nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> state,
                               nb::ndarray<float, nb::ndim<3>, nb::c_contig, nb::device::cpu> out) {
    // The gated delta rule over a prompt (decode.h): q, k [T, key_heads, key_dim]; v [T, value_heads,
    // value_dim] with contiguous heads (any token stride); g, beta [T, value_heads]; state [value_heads,
    // key_dim, value_dim] updated in place; out [T, value_heads, value_dim].
    const size_t t = q.shape(0), hk = q.shape(1), dk = q.shape(2), hv = v.shape(1), dv = v.shape(2);
    check(k.shape(0) == t && k.shape(1) == hk && k.shape(2) == dk && v.shape(0) == t && hk > 0 && hv % hk == 0 &&
              g.shape(0) == t && g.shape(1) == hv && beta.shape(0) == t && beta.shape(1) == hv &&
              state.shape(0) == hv && state.shape(1) == dk && state.shape(2) == dv && out.shape(0) == t &&
              out.shape(1) == hv && out.shape(2) == dv,
          "gated_delta_rule: shapes");
    check(v.stride(2) == 1 && v.stride(1) == static_cast<int64_t>(dv), "gated_delta_rule: v's heads must be contiguous");
    check(isa_available(Isa(isa)), "gated_delta_rule: this CPU lacks that ISA");
    DeltaRuleTokens r;
    r.tokens = static_cast<int>(t);
    r.key_heads = static_cast<int>(hk);
    r.value_heads = static_cast<int>(hv);
    r.key_dim = static_cast<int>(dk);
    r.value_dim = static_cast<int>(dv);
    r.q = q.data();
    r.k = k.data();
    r.v = v.data();
    r.v_token_stride = v.stride(0);
    r.g = g.data();
    r.beta = beta.data();
    r.state = state.data();
    r.out = out.data();
    nb::gil_scoped_release release;
    gated_delta_rule(r, threads, Isa(isa));
  });
  k.def("encode_q4", [](int threads, Weights2d w, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> codes,
                        nb::ndarray<uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> scales) {
    // Q4_G32 of w into codes [rows, ceil(cols/32)*16] and f16 scales (as uint16); 0 when every weight was
    // finite and every scale fits f16 (encode.h's EncodeStatus otherwise).
    const EncodeInput in = encode_input(w, "encode_q4");
    const int64_t blocks = (in.cols + 31) / 32;
    check(static_cast<int64_t>(codes.shape(0)) == in.rows && static_cast<int64_t>(codes.shape(1)) == blocks * 16 &&
              static_cast<int64_t>(scales.shape(0)) == in.rows && static_cast<int64_t>(scales.shape(1)) == blocks,
          "encode_q4: shapes");
    nb::gil_scoped_release release;
    return static_cast<int>(encode_q4(in, codes.data(), scales.data(), threads));
  });
  k.def("encode_fp8", [](int threads, Weights2d w, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> codes,
                         nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> scales) {
    // FP8_B128 of w into E4M3FN codes [rows, cols] and float32 tile scales [ceil(rows/128), ceil(cols/128)];
    // 0 when every weight was finite.
    const EncodeInput in = encode_input(w, "encode_fp8");
    check(static_cast<int64_t>(codes.shape(0)) == in.rows && static_cast<int64_t>(codes.shape(1)) == in.cols &&
              static_cast<int64_t>(scales.shape(0)) == (in.rows + 127) / 128 &&
              static_cast<int64_t>(scales.shape(1)) == (in.cols + 127) / 128,
          "encode_fp8: shapes");
    nb::gil_scoped_release release;
    return static_cast<int>(encode_fp8(in, codes.data(), scales.data(), threads));
  });
  k.def("stream_read", [](Bytes data, int threads) {
    nb::gil_scoped_release release;
    return stream_read(data.data(), data.shape(0), threads);
  });
  nb::class_<ExpertFormat>(k, "ExpertFormat", "A vault's record layout and the recipe's expert activation")
      .def(nb::init<uint32_t, uint32_t, uint32_t, uint32_t, bool, int, float, float>(), nb::arg("quant"),
           nb::arg("scale_dtype"), nb::arg("hidden"), nb::arg("intermediate"), nb::arg("bias") = false,
           nb::arg("activation") = 0, nb::arg("alpha") = 1.f, nb::arg("limit") = 0.f)
      .def_prop_ro("payload_bytes", [](const ExpertFormat& f) { return f.layout.payload_bytes; })
      .def_prop_ro("record_bytes", [](const ExpertFormat& f) { return f.layout.record_bytes; });
  k.attr("SILU") = static_cast<int>(ExpertActivation::Kind::Silu);
  k.attr("CLAMPED_SWIGLU") = static_cast<int>(ExpertActivation::Kind::ClampedSwiglu);
  k.def("scratch_floats", [](const ExpertFormat& f, int total_rows, int max_rows_per_task, int threads) {
    return moe_scratch_floats(f.layout, total_rows, max_rows_per_task, threads);
  });
  k.def("moe_experts",
        [](int isa, int threads, const ExpertFormat& f, const std::vector<Bytes>& records,
           const std::vector<Ints>& tokens, const std::vector<Floats1>& weights, Matrix x, OutMatrix y,
           Scratch scratch) {
          // y[T, H] += routed experts; records/tokens/weights hold one entry per expert, in combine order.
          const RecordLayout& layout = f.layout;
          const uint32_t hidden = static_cast<uint32_t>(layout.planes[4].rows);
          check(records.size() == tokens.size(), "moe_experts: one token list and weight list per record");
          for (const Bytes& r : records) check(r.shape(0) >= layout.payload_bytes, "moe_experts: record shorter than its layout");
          std::vector<ExpertTask>& tasks = build_tasks(layout, isa, threads, tokens, weights, x, y, scratch);
          for (size_t i = 0; i < records.size(); ++i) tasks[i].record = records[i].data();
          nb::gil_scoped_release release;
          moe_experts(layout, f.act, x.data(), static_cast<int>(hidden), tasks.data(),
                      static_cast<int>(tasks.size()), y.data(), scratch.data(), Isa(isa), threads);
        });
  k.def("moe_experts_ring",
        [](int isa, int threads, const ExpertFormat& f, const ExpertRing& ring, Ints slots, Ints counts, Ints tokens,
           Floats1 weights, Matrix x, OutMatrix y, Scratch scratch) {
          // As moe_experts, on records in ring slots that may still be arriving: each expert runs as soon as
          // its read completes. The tasks come flat (three arrays, not a list of arrays per expert: one
          // conversion each, on the token loop): expert i takes the next counts[i] entries of tokens and
          // weights. Returns (-1 or the index of the expert whose read failed, wait_s, total_s).
          const RecordLayout& layout = f.layout;
          const uint32_t hidden = static_cast<uint32_t>(layout.planes[4].rows);
          const size_t n = slots.shape(0);
          check(counts.shape(0) == n, "moe_experts_ring: one count per slot");
          check(tokens.shape(0) == weights.shape(0), "moe_experts_ring: tokens and weights differ in length");
          check(layout.record_bytes <= ring.slot_bytes(), "moe_experts_ring: records larger than the ring's slots");
          check(x.shape(1) == hidden && y.shape(1) == hidden && x.shape(0) == y.shape(0), "moe_experts_ring: x/y shape");
          check(isa_available(Isa(isa)), "moe_experts_ring: this CPU lacks that ISA");
          thread_local std::vector<ExpertTask> tasks;
          tasks.clear();
          size_t at = 0;
          int max_n = 0;
          for (size_t i = 0; i < n; ++i) {
            const int cnt = counts.data()[i];
            check(cnt > 0 && at + static_cast<size_t>(cnt) <= tokens.shape(0), "moe_experts_ring: counts overrun the tokens");
            for (int j = 0; j < cnt; ++j)
              check(tokens.data()[at + j] >= 0 && static_cast<size_t>(tokens.data()[at + j]) < x.shape(0),
                    "moe_experts_ring: token index out of range");
            const int32_t s = slots.data()[i];
            check(s >= 0 && static_cast<uint64_t>(s) < ring.n_slots(), "moe_experts_ring: slot out of range");
            tasks.push_back({ring.slot(s), tokens.data() + at, weights.data() + at, cnt, s});
            at += cnt;
            max_n = cnt > max_n ? cnt : max_n;
          }
          check(at == tokens.shape(0), "moe_experts_ring: counts do not cover the tokens");
          check(scratch.shape(0) >= moe_scratch_floats(layout, static_cast<int>(at), max_n, threads),
                "moe_experts_ring: scratch too small");
          MoeTiming timing;
          int failed;
          {
            nb::gil_scoped_release release;
            failed = moe_experts(layout, f.act, x.data(), static_cast<int>(hidden), tasks.data(),
                                 static_cast<int>(tasks.size()), y.data(), scratch.data(), Isa(isa), threads, &ring,
                                 &timing);
          }
          return std::make_tuple(failed, timing.wait_s, timing.total_s);
        });
}

void init_io(nb::module_& m) {
  nb::module_ io = m.def_submodule("io", "The expert ring: slots, atomic slot states, background record reads");
  io.attr("EMPTY") = static_cast<int>(SlotState::Empty);
  io.attr("LOADING") = static_cast<int>(SlotState::Loading);
  io.attr("READY") = static_cast<int>(SlotState::Ready);
  io.attr("IN_USE") = static_cast<int>(SlotState::InUse);
  io.attr("FAILED") = static_cast<int>(SlotState::Failed);
  io.def("crc32", [](Bytes data, uint32_t crc) { return crc32(crc, data.data(), data.shape(0)); },
         nb::arg("data"), nb::arg("crc") = 0);
  io.def("widen_record", [](nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> buf, uint32_t stored,
                            uint32_t hidden, uint32_t intermediate) {
    // A Q3_G32 or Q2_G32 record at the start of buf, rewritten in place as its Q4_G32 record.
    check(stored == static_cast<uint32_t>(QuantType::Q3_G32) || stored == static_cast<uint32_t>(QuantType::Q2_G32),
          "only Q3_G32 and Q2_G32 records widen");
    check(hidden > 0 && intermediate > 0 &&
          buf.shape(0) >= record_layout(QuantType::Q4_G32, ScaleDtype::F16, hidden, intermediate).payload_bytes,
          "the buffer does not hold a Q4_G32 record of this geometry");
    nb::gil_scoped_release release;
    widen_record(buf.data(), QuantType(stored), hidden, intermediate);
  }, nb::arg("buf"), nb::arg("stored"), nb::arg("hidden"), nb::arg("intermediate"));
  nb::class_<ExpertRing>(io, "ExpertRing")
      .def(nb::init<int, int, uint64_t, uint64_t, int, bool>(), nb::arg("direct_fd"), nb::arg("buffered_fd"),
           nb::arg("n_slots"), nb::arg("slot_bytes"), nb::arg("io_threads"), nb::arg("verify") = true)
      .def_prop_ro("n_slots", &ExpertRing::n_slots)
      .def_prop_ro("slot_bytes", &ExpertRing::slot_bytes)
      .def_prop_ro("address", [](const ExpertRing& r) { return reinterpret_cast<uintptr_t>(r.memory()); })
      .def_prop_ro("fell_back", &ExpertRing::fell_back)
      .def("inject_faults", &ExpertRing::inject_faults, nb::arg("count"), nb::arg("error"),
           "tests only: the next `count` reads fail with errno `error`, or come back short when it is 0")
      .def_prop_ro("bytes_read", &ExpertRing::bytes_read)
      .def_prop_ro("busy_seconds", &ExpertRing::busy_seconds,
                   "seconds during which at least one read was in progress")
      .def("view", [](nb::handle self) {
            // The whole ring as a uint8 array [n_slots, slot_bytes] (no copy; keeps the ring alive).
            ExpertRing& r = nb::cast<ExpertRing&>(self);
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(r.memory(), {r.n_slots(), r.slot_bytes()}, self);
          })
      .def("state", [](const ExpertRing& r, uint64_t i) {
            check(i < r.n_slots(), "slot out of range");
            return static_cast<int>(r.state(i));
          })
      .def("set_state", [](ExpertRing& r, uint64_t i, int s) {
            check(i < r.n_slots() && s >= 0 && s <= static_cast<int>(SlotState::Failed), "slot or state out of range");
            r.set_state(i, SlotState(s));
          })
      .def("submit", [](ExpertRing& r, uint64_t i, uint64_t offset, uint64_t length, uint32_t crc, bool background,
                        uint32_t stored) {
            try {
              r.submit(i, offset, length, crc, background, stored);
            } catch (const std::exception& e) {
              throw nb::value_error(e.what());
            }
          }, nb::arg("slot"), nb::arg("offset"), nb::arg("length"), nb::arg("crc"), nb::arg("background") = false,
          nb::arg("stored") = 0)
      .def("set_record_geometry", [](ExpertRing& r, uint32_t hidden, uint32_t intermediate) {
            try {
              r.set_record_geometry(hidden, intermediate);
            } catch (const std::exception& e) {
              throw nb::value_error(e.what());
            }
          }, nb::arg("hidden"), nb::arg("intermediate"))
      .def("expedite", [](ExpertRing& r, uint64_t i) {
            check(i < r.n_slots(), "slot out of range");
            return r.expedite(i);
          })
      .def("cancel", [](ExpertRing& r, uint64_t i) {
            check(i < r.n_slots(), "slot out of range");
            return r.cancel(i);
          })
      .def("discard", [](ExpertRing& r, uint64_t i) {
            try {
              r.discard(i);
            } catch (const std::exception& e) {
              throw nb::value_error(e.what());
            }
          })
      .def("wait", [](const ExpertRing& r, uint64_t i) {
            check(i < r.n_slots(), "slot out of range");
            nb::gil_scoped_release release;
            return static_cast<int>(r.wait(i));
          })
      .def("failure", [](const ExpertRing& r, uint64_t i) {
            // (errno, bad_crc, offset, bytes done, length) of the last failed read into slot i.
            check(i < r.n_slots(), "slot out of range");
            const ReadFailure f = r.failure(i);
            return std::make_tuple(f.error, f.bad_crc, f.offset, f.done, f.length);
          })
      .def("shutdown", [](ExpertRing& r) {
            nb::gil_scoped_release release;
            r.shutdown();
          });
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Mosaic native core: the format mirror, the expert kernels, the decode step and the expert ring";
  init_format(m);
  init_kernels(m);
  init_io(m);
  init_decode(m);
}
