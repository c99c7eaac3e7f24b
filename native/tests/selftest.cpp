// The native core without Python: every kernel of this build's ISAs against the scalar reference on odd
// shapes, and the CRC against a bit-at-a-time one. It is how a build for another CPU is tested where the
// Python suite cannot run (the AArch64 cross build under qemu-user, `make test-arm`); the Python tests
// (tests/test_kernels.py and others) hold the same kernels to torch on the machine that runs them.
// Prints one line per check that fails and a summary; exits 1 when any failed.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mosaic/crc32.h"
#include "mosaic/decode.h"
#include "mosaic/kernels.h"
#include "mosaic/vault_format.h"

using namespace mosaic;

namespace {

int checks = 0, failures = 0;
std::mt19937 rng(20261203);

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
uint8_t byte() { return static_cast<uint8_t>(rng() & 0xFF); }
std::vector<float> floats(size_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = uniform(-1.f, 1.f);
  return v;
}
uint16_t bf16_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}
uint16_t f16_scale() { return static_cast<uint16_t>(((8 + rng() % 5) << 10) | (rng() & 0x3FF)); }  // 2^-7..2^-3
uint8_t e4m3_code() {
  const uint8_t b = byte();
  return (b & 0x7F) == 0x7F ? b & 0xF0 : b;  // no NaN
}

// Each ISA of this build but the scalar one, float ones first.
std::vector<Isa> isas_under_test() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Avx2, Isa::Avx512, Isa::Neon, Isa::Avx2Int8, Isa::AvxVnni, Isa::Avx512Vnni, Isa::Amx,
                  Isa::NeonDot, Isa::NeonI8mm})
    if (isa_available(isa)) out.push_back(isa);
  return out;
}

bool int8_activations(Isa isa) { return isa != vector_isa(isa); }

std::string where(const char* kernel, Isa isa, int rows, int cols, int n) {
  return std::string(kernel) + " " + isa_name(isa) + " rows " + std::to_string(rows) + " cols " +
         std::to_string(cols) + " n " + std::to_string(n);
}

// |got - want| within the bound per element: float rounding (rel of the absolute products) or, for int8
// activations, their rounding error against the weights' absolute sums.
void compare(const std::vector<float>& got, const std::vector<float>& want, const std::vector<float>& bound,
             const std::string& what) {
  float worst = 0.f;
  bool ok = true;
  for (size_t i = 0; i < want.size(); ++i) {
    const float err = std::fabs(got[i] - want[i]);
    ok = ok && err <= bound[i];  // a NaN fails too
    worst = std::max(worst, err / bound[i]);
  }
  expect(ok, what + " (worst error " + std::to_string(worst) + " of its bound)");
}

// --- expert matvecs ----------------------------------------------------------------------------------

struct Matrix {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> scales;  // raw bytes of the scale plane
  ScaleDtype dtype;
  std::vector<float> dequant;   // rows x cols, the reference's weights
};

// Random codes, or every code byte `fill` (fill >= 0): the int8 loops' largest sums.
Matrix random_matrix(QuantType quant, int rows, int cols, int fill = -1) {
  Matrix m;
  const int blocks = (cols + 31) / 32;
  m.dequant.assign(static_cast<size_t>(rows) * cols, 0.f);
  if (quant == QuantType::FP8_B128) {
    const int srows = (rows + 127) / 128, scols = (cols + 127) / 128;
    m.dtype = ScaleDtype::F32;
    m.codes.resize(static_cast<size_t>(rows) * cols);
    for (auto& c : m.codes) c = e4m3_code();
    std::vector<float> s(static_cast<size_t>(srows) * scols);
    for (float& x : s) x = uniform(0.001f, 0.01f);
    m.scales.resize(s.size() * 4);
    std::memcpy(m.scales.data(), s.data(), m.scales.size());
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        m.dequant[static_cast<size_t>(r) * cols + c] =
            e4m3_to_f32(m.codes[static_cast<size_t>(r) * cols + c]) * s[(r / 128) * scols + c / 128];
    return m;
  }
  m.codes.resize(static_cast<size_t>(rows) * blocks * 16);
  for (auto& c : m.codes) c = fill >= 0 ? static_cast<uint8_t>(fill) : byte();
  const bool mx = quant == QuantType::MXFP4_G32;
  m.dtype = mx ? ScaleDtype::E8M0 : ScaleDtype::F16;
  m.scales.resize(static_cast<size_t>(rows) * blocks * (mx ? 1 : 2));
  for (int i = 0; i < rows * blocks; ++i) {
    if (mx) m.scales[i] = static_cast<uint8_t>(120 + rng() % 8);
    else {
      const uint16_t h = f16_scale();
      std::memcpy(m.scales.data() + 2 * i, &h, 2);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const int b = c / 32, j = c % 32, at = r * blocks + b;
      const uint8_t* blk = m.codes.data() + static_cast<size_t>(at) * 16;
      float w;
      if (mx) w = kE2m1[(blk[j / 2] >> (4 * (j & 1))) & 0xF] * e8m0_to_f32(m.scales[at]);
      else {
        uint16_t h;
        std::memcpy(&h, m.scales.data() + 2 * at, 2);
        w = (static_cast<float>(j < 16 ? blk[j] & 0xF : blk[j - 16] >> 4) - 8.f) * f16_to_f32(h);
      }
      m.dequant[static_cast<size_t>(r) * cols + c] = w;
    }
  return m;
}

void check_matvec() {
  const QuantType quants[] = {QuantType::Q4_G32, QuantType::FP8_B128, QuantType::MXFP4_G32};
  // {rows, cols, tokens}: every remainder of the int8 loops' token tiles (and of SMMLA's row and token pairs),
  // and rows of 8200 columns, whose prefills go in several 64 KB row panels (the last one short, and odd)
  std::vector<std::array<int, 3>> cases;
  for (auto [rows, cols] : {std::pair{1, 32}, {3, 40}, {17, 96}, {33, 257}, {130, 200}, {8, 1000}})
    for (int n : {1, 2, 3, 5, 7}) cases.push_back({rows, cols, n});
  // prefills of whole and partial AMX tiles (16 rows, 16 tokens; 10 tokens take them), and every remainder
  // of the rows-in-lanes loops' token groups (12, 6 and 4)
  for (auto [rows, cols] : {std::pair{17, 96}, {33, 257}, {130, 200}})
    for (int n : {8, 9, 10, 11, 16, 19, 35}) cases.push_back({rows, cols, n});
  cases.push_back({9, 8200, 37});
  cases.push_back({41, 8200, 11});
  cases.push_back({41, 8200, 37});  // rows-in-lanes tiles in two panels (prefill_tile_panel), the last tile short
  // The largest codes (Q4 0xF, MXFP4 +6, each loop's biggest unsigned code) against activations of one
  // magnitude (int8 +-127 throughout, the sign alternating by token): sums an int16 stage would overflow
  // if it held more than the loops allow.
  const int n_random = static_cast<int>(cases.size());
  for (int n : {1, 5, 13}) cases.push_back({17, 256, n});
  for (Isa isa : isas_under_test())
    for (QuantType quant : quants)
      for (int c = 0; c < static_cast<int>(cases.size()); ++c) {
        const auto [rows, cols, n] = cases[c];
        const bool extreme = c >= n_random;
        if (extreme && quant == QuantType::FP8_B128) continue;
        const Matrix m = random_matrix(quant, rows, cols, extreme ? (quant == QuantType::Q4_G32 ? 0xFF : 0x77) : -1);
        const int ldx = cols + 3, ldy = rows + 1;  // strides past the data, as the drivers pass them
        std::vector<float> x = floats(static_cast<size_t>(n) * ldx);
        if (extreme)
          for (size_t i = 0; i < x.size(); ++i) x[i] = (i / ldx) % 2 ? -1.f : 1.f;
        std::vector<float> want(static_cast<size_t>(n) * ldy, 0.f), got(want.size(), 0.f), bound(want.size(), 1e-6f);
        MatvecArgs args{m.codes.data(), m.scales.data(), m.dtype, rows, cols, x.data(), ldx, n, want.data(), ldy};
        kernels_for(Isa::Scalar).of(quant)(args);
        args.y = got.data();
        kernels_for(isa).of(quant)(args);
        for (int t = 0; t < n; ++t)
          for (int r = 0; r < rows; ++r) {
            double abs_sum = 0, amax_sum = 0;  // sum |w x|; sum over blocks of |w|_1 * amax(x block)
            for (int b = 0; b * 32 < cols; ++b) {
              double wsum = 0, amax = 0;
              for (int c = b * 32; c < std::min(cols, b * 32 + 32); ++c) {
                const double w = m.dequant[static_cast<size_t>(r) * cols + c], xc = x[static_cast<size_t>(t) * ldx + c];
                abs_sum += std::fabs(w * xc);
                wsum += std::fabs(w);
                amax = std::max(amax, std::fabs(xc));
              }
              amax_sum += wsum * amax;
            }
            // int8: each activation off by at most half a step (amax / 254) of its block
            const double b = 1e-5 * abs_sum + (int8_activations(isa) ? amax_sum / 254.0 * 1.01 : 0.0) + 1e-6;
            bound[static_cast<size_t>(t) * ldy + r] = static_cast<float>(b);
          }
        const char* name = quant == QuantType::Q4_G32 ? (extreme ? "q4 largest codes" : "q4")
                           : quant == QuantType::FP8_B128 ? "fp8"
                                                          : (extreme ? "mxfp4 largest codes" : "mxfp4");
        compare(got, want, bound, where(name, isa, rows, cols, n));
      }
}

// --- the experts' activations against float64 ----------------------------------------------------

void check_activation() {
  // every input from -100 to 100 in steps of 1/64 (past both ends of exp's clamp), with u = 1 and u = -3
  std::vector<float> g0;
  for (int i = -6400; i <= 6400; ++i) g0.push_back(static_cast<float>(i) / 64.f);
  const ExpertActivation kinds[] = {ExpertActivation{}, ExpertActivation{ExpertActivation::Kind::ClampedSwiglu, 1.702f, 7.f}};
  for (const ExpertActivation& act : kinds) {
    const bool clamped = act.kind == ExpertActivation::Kind::ClampedSwiglu;
    for (float uv : {1.f, -3.f}) {
      std::vector<float> g = g0, u(g0.size(), uv);
      apply_activation(act, g.data(), u.data(), g.size());
      double worst = 0.0;
      for (size_t i = 0; i < g0.size(); ++i) {
        double x = g0[i], y = uv;
        if (clamped) x = std::min(x, 7.0), y = std::max(-7.0, std::min(y, 7.0));
        // exp's argument as the float product it is (its rounding is the caller's, not exp's)
        const double arg = clamped ? -act.alpha * static_cast<float>(x) : -x;
        const double want = clamped ? (y + 1.0) * x / (1.0 + std::exp(arg)) : x / (1.0 + std::exp(arg)) * y;
        worst = std::max(worst, std::fabs(g[i] - want) / (std::fabs(want) * 1e-6 + 1e-30));
      }
      expect(worst <= 1.0, std::string(clamped ? "clamped swiglu" : "silu") + " within 1e-6 relative of float64 (worst " +
                                std::to_string(worst) + " of it)");
    }
    float g[2] = {std::nanf(""), 1.f}, u[2] = {1.f, std::nanf("")};
    apply_activation(act, g, u, 2);
    expect(std::isnan(g[0]) && std::isnan(g[1]), std::string(clamped ? "clamped swiglu" : "silu") + " keeps NaN");
  }
}

// --- a whole MoE layer through the driver, on 1 and 2 threads --------------------------------------

void check_moe() {
  const int hidden = 96, inter = 72, experts = 5;
  for (Isa isa : isas_under_test())
    for (QuantType quant : {QuantType::Q4_G32, QuantType::MXFP4_G32}) {
      const bool mx = quant == QuantType::MXFP4_G32;
      const RecordLayout layout = record_layout(quant, mx ? ScaleDtype::E8M0 : ScaleDtype::F16, hidden, inter, mx);
      std::vector<std::vector<uint8_t>> records(experts, std::vector<uint8_t>(layout.record_bytes, 0));
      for (auto& rec : records)
        for (size_t p = 0; p < layout.planes.size(); ++p) {
          const Plane& pl = layout.planes[p];
          uint8_t* at = rec.data() + pl.offset;
          if (pl.kind == PlaneKind::Codes)
            for (uint64_t i = 0; i < pl.nbytes; ++i) at[i] = byte();
          else if (pl.kind == PlaneKind::Bias)
            for (uint64_t i = 0; i < pl.nbytes / 4; ++i) reinterpret_cast<float*>(at)[i] = uniform(-0.1f, 0.1f);
          else
            for (uint64_t i = 0; i < pl.nbytes / (mx ? 1 : 2); ++i) {
              if (mx) at[i] = static_cast<uint8_t>(122 + rng() % 4);
              else reinterpret_cast<uint16_t*>(at)[i] = f16_scale();
            }
        }
      const ExpertActivation act = mx ? ExpertActivation{ExpertActivation::Kind::ClampedSwiglu, 1.702f, 7.f}
                                      : ExpertActivation{};
      for (int tokens : {1, 3}) {
        const std::vector<float> x = floats(static_cast<size_t>(tokens) * hidden);
        // every token to experts 0, 2 and 4 (weights differing by token)
        std::vector<std::vector<int32_t>> idx(3);
        std::vector<std::vector<float>> wts(3);
        std::vector<ExpertTask> tasks;
        for (int e = 0; e < 3; ++e) {
          for (int t = 0; t < tokens; ++t) idx[e].push_back(t), wts[e].push_back(0.2f + 0.1f * e + 0.05f * t);
        }
        for (int e = 0; e < 3; ++e) tasks.push_back({records[2 * e].data(), idx[e].data(), wts[e].data(), tokens});
        std::vector<float> scratch(moe_scratch_floats(layout, 3 * tokens, tokens, 2));
        std::vector<float> want(static_cast<size_t>(tokens) * hidden, 0.f);
        moe_experts(layout, act, x.data(), hidden, tasks.data(), 3, want.data(), scratch.data(), Isa::Scalar, 1);
        float scale = 0.f;
        for (float v : want) scale = std::max(scale, std::fabs(v));
        for (int threads : {1, 2}) {
          std::vector<float> got(want.size(), 0.f);
          moe_experts(layout, act, x.data(), hidden, tasks.data(), 3, got.data(), scratch.data(), isa, threads);
          // int8 activations: about 1 % of the output's scale through two projections; float: rounding
          const float tol = (int8_activations(isa) ? 3e-2f : 1e-4f) * scale + 1e-5f;
          compare(got, want, std::vector<float>(want.size(), tol),
                  std::string("moe_experts ") + (mx ? "mxfp4 " : "q4 ") + isa_name(isa) + " tokens " +
                      std::to_string(tokens) + " threads " + std::to_string(threads));
        }
      }
    }
}

// --- backbone projections ----------------------------------------------------------------------------

void check_linear() {
  const int shapes[][2] = {{1, 8}, {5, 17}, {6, 35}, {7, 40}, {33, 100}, {64, 257}};  // every bf16 row group size
  for (Isa isa : isas_under_test())
    for (const auto& shape : shapes)
      for (int n : {1, 3, 6}) {
        const int rows = shape[0], cols = shape[1];
        const std::vector<float> x = floats(static_cast<size_t>(n) * cols), wf = floats(static_cast<size_t>(rows) * cols);
        std::vector<uint16_t> wb(wf.size());
        std::vector<uint8_t> w8(wf.size()), wfp8(wf.size());
        for (size_t i = 0; i < wf.size(); ++i) wb[i] = bf16_of(wf[i]), w8[i] = byte(), wfp8[i] = e4m3_code();
        std::vector<float> scales(rows);
        for (float& s : scales) s = uniform(0.001f, 0.01f);
        std::vector<float> want(static_cast<size_t>(n) * rows), got(want.size());
        auto bound_of = [&](auto weight) {
          std::vector<float> b(want.size());
          for (int t = 0; t < n; ++t)
            for (int r = 0; r < rows; ++r) {
              double s = 0;
              for (int c = 0; c < cols; ++c) s += std::fabs(weight(r, c) * x[static_cast<size_t>(t) * cols + c]);
              b[static_cast<size_t>(t) * rows + r] = static_cast<float>(1e-5 * s + 1e-6);
            }
          return b;
        };
        linear_bf16(wb.data(), rows, cols, x.data(), n, want.data(), 1, Isa::Scalar);
        linear_bf16(wb.data(), rows, cols, x.data(), n, got.data(), 2, isa);
        compare(got, want, bound_of([&](int r, int c) { return bf16_to_f32(wb[static_cast<size_t>(r) * cols + c]); }),
                where("linear_bf16", isa, rows, cols, n));
        for (bool fp8 : {false, true}) {
          const std::vector<uint8_t>& w = fp8 ? wfp8 : w8;
          linear_quant(w.data(), scales.data(), fp8, rows, cols, x.data(), n, want.data(), 1, Isa::Scalar);
          linear_quant(w.data(), scales.data(), fp8, rows, cols, x.data(), n, got.data(), 2, isa);
          compare(got, want, bound_of([&](int r, int c) {
                    const uint8_t b = w[static_cast<size_t>(r) * cols + c];
                    return (fp8 ? e4m3_to_f32(b) : static_cast<float>(static_cast<int8_t>(b))) * scales[r];
                  }),
                  where(fp8 ? "linear_quant fp8" : "linear_quant int8", isa, rows, cols, n));
        }
      }
}

// --- decode attention --------------------------------------------------------------------------------

void check_attention() {
  struct Case {
    int heads, kv_heads, dim, length;
    bool sinks;
  };
  const Case cases[] = {{1, 1, 8, 1, false}, {4, 2, 24, 17, true}, {8, 2, 64, 600, false},
                        {6, 3, 128, 33, true}, {4, 1, 80, 515, false}, {2, 2, 36, 5, false},
                        {130, 2, 32, 21, true}};  // more query heads a KV head (65) than a task takes
  for (Isa isa : isas_under_test())
    for (const Case& c : cases) {
      const int64_t stride = static_cast<int64_t>(c.length + 3) * c.dim;  // head rows apart, as a paged cache's
      const std::vector<float> q = floats(static_cast<size_t>(c.heads) * c.dim);
      std::vector<float> k = floats(static_cast<size_t>(c.kv_heads) * stride), v = floats(k.size());
      for (float& x : k) x *= 3.f;  // peaked softmax
      std::vector<uint16_t> kb(k.size()), vb(v.size());
      std::vector<int8_t> k8(k.size()), v8(v.size());
      std::vector<float> ks(static_cast<size_t>(c.kv_heads) * (c.length + 3)), vs(ks.size());
      for (size_t i = 0; i < k.size(); ++i) {
        kb[i] = bf16_of(k[i]), vb[i] = bf16_of(v[i]);
        k8[i] = static_cast<int8_t>(rng() % 255 - 127), v8[i] = static_cast<int8_t>(rng() % 255 - 127);
      }
      for (size_t i = 0; i < ks.size(); ++i) ks[i] = uniform(0.001f, 0.03f), vs[i] = uniform(0.001f, 0.01f);
      std::vector<float> sinks(c.heads);
      for (float& s : sinks) s = uniform(-1.f, 2.f);
      const float* sk = c.sinks ? sinks.data() : nullptr;
      const float scale = 1.f / std::sqrt(static_cast<float>(c.dim));
      const size_t out_n = static_cast<size_t>(c.heads) * c.dim;
      std::vector<float> want(out_n), got(out_n), bound(out_n, 2e-5f);
      const std::string shape = " heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " dim " +
                                std::to_string(c.dim) + " length " + std::to_string(c.length);
      decode_attention(q.data(), c.heads, c.dim, k.data(), v.data(), stride, stride, c.kv_heads, c.length, scale,
                       want.data(), 1, Isa::Scalar, sk);
      decode_attention(q.data(), c.heads, c.dim, k.data(), v.data(), stride, stride, c.kv_heads, c.length, scale,
                       got.data(), 2, isa, sk);
      compare(got, want, bound, std::string("attention f32 ") + isa_name(isa) + shape);
      decode_attention_bf16(q.data(), c.heads, c.dim, kb.data(), vb.data(), stride, stride, c.kv_heads, c.length,
                            scale, want.data(), 1, Isa::Scalar, sk);
      decode_attention_bf16(q.data(), c.heads, c.dim, kb.data(), vb.data(), stride, stride, c.kv_heads, c.length,
                            scale, got.data(), 2, isa, sk);
      compare(got, want, bound, std::string("attention bf16 ") + isa_name(isa) + shape);
      decode_attention_i8(q.data(), c.heads, c.dim, k8.data(), v8.data(), stride, stride, ks.data(), vs.data(),
                          c.length + 3, c.kv_heads, c.length, scale, want.data(), 1, Isa::Scalar, sk);
      decode_attention_i8(q.data(), c.heads, c.dim, k8.data(), v8.data(), stride, stride, ks.data(), vs.data(),
                          c.length + 3, c.kv_heads, c.length, scale, got.data(), 2, isa, sk);
      // the integer VNNI task rounds queries and probabilities to 16 bits (about 1e-4 of the output)
      const float i8_tol = has_avx512_vnni(isa) ? 2e-3f : 2e-5f;
      compare(got, want, std::vector<float>(out_n, i8_tol), std::string("attention int8 ") + isa_name(isa) + shape);
    }
}

// A prompt chunk's attention (prefill_attention, every cache type) against the scalar decode kernel run for
// each position alone over the keys up to it.
void check_prefill_attention() {
  struct Case {
    int tokens, start, heads, kv_heads, dim;
  };
  const Case cases[] = {{1, 0, 2, 1, 8}, {9, 0, 8, 2, 64}, {19, 530, 6, 3, 128}, {11, 3, 4, 1, 80},
                        {3, 40, 130, 2, 32}, {70, 7, 32, 4, 64}};  // 65 query heads a KV head (33 + 32); blocks of 8 positions, then 6
  for (Isa isa : isas_under_test())
    for (const Case& c : cases) {
      const int length = c.start + c.tokens, rows = length + 5;  // the cache runs past the chunk
      const int64_t stride = static_cast<int64_t>(rows) * c.dim;
      const size_t out_n = static_cast<size_t>(c.tokens) * c.heads * c.dim;
      const std::vector<float> q = floats(out_n);
      std::vector<float> k = floats(static_cast<size_t>(c.kv_heads) * stride), v = floats(k.size());
      for (float& x : k) x *= 3.f;
      std::vector<uint16_t> kb(k.size()), vb(v.size());
      std::vector<int8_t> k8(k.size()), v8(v.size());
      std::vector<float> ks(static_cast<size_t>(c.kv_heads) * rows), vs(ks.size());
      for (size_t i = 0; i < k.size(); ++i) {
        kb[i] = bf16_of(k[i]), vb[i] = bf16_of(v[i]);
        k8[i] = static_cast<int8_t>(rng() % 255 - 127), v8[i] = static_cast<int8_t>(rng() % 255 - 127);
      }
      for (size_t i = 0; i < ks.size(); ++i) ks[i] = uniform(0.001f, 0.03f), vs[i] = uniform(0.001f, 0.01f);
      const float scale = 1.f / std::sqrt(static_cast<float>(c.dim));
      const size_t row_n = static_cast<size_t>(c.heads) * c.dim;
      std::vector<float> want(out_n), got(out_n);
      const std::vector<float> bound(out_n, 2e-5f);
      const std::string shape = " tokens " + std::to_string(c.tokens) + " from " + std::to_string(c.start) +
                                " heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " dim " +
                                std::to_string(c.dim);
      auto per_position = [&](auto decode) {
        for (int t = 0; t < c.tokens; ++t) decode(q.data() + t * row_n, c.start + t + 1, want.data() + t * row_n);
      };
      per_position([&](const float* qt, int n, float* o) {
        decode_attention(qt, c.heads, c.dim, k.data(), v.data(), stride, stride, c.kv_heads, n, scale, o, 1,
                         Isa::Scalar);
      });
      prefill_attention(q.data(), c.tokens, c.heads, c.dim, k.data(), v.data(), stride, stride, c.kv_heads, c.start,
                        scale, got.data(), 2, isa);
      compare(got, want, bound, std::string("prefill attention f32 ") + isa_name(isa) + shape);
      per_position([&](const float* qt, int n, float* o) {
        decode_attention_bf16(qt, c.heads, c.dim, kb.data(), vb.data(), stride, stride, c.kv_heads, n, scale, o, 1,
                              Isa::Scalar);
      });
      prefill_attention_bf16(q.data(), c.tokens, c.heads, c.dim, kb.data(), vb.data(), stride, stride, c.kv_heads,
                             c.start, scale, got.data(), 2, isa);
      compare(got, want, bound, std::string("prefill attention bf16 ") + isa_name(isa) + shape);
      per_position([&](const float* qt, int n, float* o) {
        decode_attention_i8(qt, c.heads, c.dim, k8.data(), v8.data(), stride, stride, ks.data(), vs.data(), rows,
                            c.kv_heads, n, scale, o, 1, Isa::Scalar);
      });
      prefill_attention_i8(q.data(), c.tokens, c.heads, c.dim, k8.data(), v8.data(), stride, stride, ks.data(),
                           vs.data(), rows, c.kv_heads, c.start, scale, got.data(), 2, isa);
      compare(got, want, bound, std::string("prefill attention int8 ") + isa_name(isa) + shape);
    }
}

// --- the gated delta rule over a prompt -----------------------------------------------------------------

// Every ISA's gated_delta_rule (the scalar one too) against the recurrence in double, one token at a time.
void check_delta_rule() {
  struct Case {
    int tokens, key_heads, value_heads, dk, dv;
  };
  const Case cases[] = {{1, 1, 1, 8, 8}, {7, 2, 6, 17, 45}, {70, 1, 2, 128, 128}, {33, 3, 3, 20, 97}};
  std::vector<Isa> isas = isas_under_test();
  isas.insert(isas.begin(), Isa::Scalar);
  for (const Case& c : cases) {
    const int rep = c.value_heads / c.key_heads;
    const size_t qk_n = static_cast<size_t>(c.tokens) * c.key_heads * c.dk;
    const size_t v_n = static_cast<size_t>(c.tokens) * c.value_heads * c.dv;
    const size_t s_n = static_cast<size_t>(c.value_heads) * c.dk * c.dv;
    std::vector<float> q = floats(qk_n), k = floats(qk_n), v = floats(v_n), s0 = floats(s_n);
    std::vector<float> g(static_cast<size_t>(c.tokens) * c.value_heads), beta(g.size());
    for (size_t i = 0; i < g.size(); ++i) g[i] = uniform(-3.f, 0.f), beta[i] = uniform(0.f, 1.f);
    for (size_t row = 0; row < qk_n; row += c.dk) {  // unit keys, queries by 1/sqrt(dk), as the mixer's
      double qq = 0, kk = 0;
      for (int i = 0; i < c.dk; ++i) qq += q[row + i] * q[row + i], kk += k[row + i] * k[row + i];
      for (int i = 0; i < c.dk; ++i) q[row + i] /= std::sqrt(qq * c.dk), k[row + i] /= std::sqrt(kk);
    }
    std::vector<double> S(s0.begin(), s0.end()), u(c.dv);
    std::vector<float> want(v_n);
    for (int t = 0; t < c.tokens; ++t)
      for (int h = 0; h < c.value_heads; ++h) {
        const size_t tv = static_cast<size_t>(t) * c.value_heads + h;
        const float* qt = q.data() + (static_cast<size_t>(t) * c.key_heads + h / rep) * c.dk;
        const float* kt = k.data() + (static_cast<size_t>(t) * c.key_heads + h / rep) * c.dk;
        double* Sh = S.data() + static_cast<size_t>(h) * c.dk * c.dv;
        for (int j = 0; j < c.dv; ++j) {
          double kv = 0;
          for (int i = 0; i < c.dk; ++i) kv += (Sh[i * c.dv + j] *= std::exp(static_cast<double>(g[tv]))) * kt[i];
          u[j] = (v[tv * c.dv + j] - kv) * beta[tv];
          double o = 0;
          for (int i = 0; i < c.dk; ++i) o += (Sh[i * c.dv + j] += kt[i] * u[j]) * qt[i];
          want[tv * c.dv + j] = static_cast<float>(o);
        }
      }
    for (Isa isa : isas) {
      std::vector<float> state = s0, got(v_n);
      DeltaRuleTokens r;
      r.tokens = c.tokens, r.key_heads = c.key_heads, r.value_heads = c.value_heads, r.key_dim = c.dk;
      r.value_dim = c.dv, r.q = q.data(), r.k = k.data(), r.v = v.data();
      r.v_token_stride = static_cast<int64_t>(c.value_heads) * c.dv;
      r.g = g.data(), r.beta = beta.data(), r.out = got.data(), r.state = state.data();
      gated_delta_rule(r, 2, isa);
      const std::string shape = std::string(" ") + isa_name(isa) + " tokens " + std::to_string(c.tokens) +
                                " heads " + std::to_string(c.key_heads) + "/" + std::to_string(c.value_heads) +
                                " dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv);
      compare(got, want, std::vector<float>(v_n, 1e-4f), "delta rule out" + shape);
      std::vector<float> want_state(S.begin(), S.end());
      compare(state, want_state, std::vector<float>(s_n, 1e-4f), "delta rule state" + shape);
    }
  }
}

// --- CRC-32 and the stream ---------------------------------------------------------------------------

uint32_t crc32_bitwise(const uint8_t* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

void check_crc32() {
  std::vector<uint8_t> data(70000);
  for (auto& b : data) b = byte();
  expect(crc32(0, reinterpret_cast<const uint8_t*>("123456789"), 9) == 0xCBF43926u, "crc32 check value");
  for (size_t offset : {0, 1, 7}) {
    for (size_t n : {0, 1, 15, 63, 64, 65, 1000, 16384, 69000}) {
      const uint8_t* p = data.data() + offset;
      expect(crc32(0, p, n) == crc32_bitwise(p, n),
             "crc32 offset " + std::to_string(offset) + " length " + std::to_string(n));
      if (n > 10)  // a running CRC in two pieces
        expect(crc32(crc32(0, p, n / 3), p + n / 3, n - n / 3) == crc32_bitwise(p, n),
               "crc32 continued, length " + std::to_string(n));
    }
  }
}

void check_stream() {
  std::vector<uint64_t> lanes(1 << 17);  // 1 MiB of 64-bit lanes holding 0, 1, 2, ...
  for (size_t i = 0; i < lanes.size(); ++i) lanes[i] = i;
  const double want = static_cast<double>(lanes.size()) * (lanes.size() - 1) / 2;
  expect(stream_read(reinterpret_cast<const uint8_t*>(lanes.data()), lanes.size() * 8, 2) == want, "stream_read sum");
}

}  // namespace

int main() {
  std::printf("best_isa %s, int8_isa %s; testing:", isa_name(best_isa()), isa_name(int8_isa()));
  for (Isa isa : isas_under_test()) std::printf(" %s", isa_name(isa));
  std::printf("\n");
  check_matvec();
  check_activation();
  check_moe();
  check_linear();
  check_attention();
  check_prefill_attention();
  check_delta_rule();
  check_crc32();
  check_stream();
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
