// Expert FFN kernels on raw pointers: y += w * down(silu(gate x) * up x), weights dequantised inline.
// One scalar reference and one implementation per ISA, chosen at run time (kernels_dispatch.cpp).
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#include "mosaic/vault_format.h"

namespace mosaic {

// The format's block sizes as ints, for index arithmetic in the kernels.
inline constexpr int kQ4 = static_cast<int>(kQ4Block);
inline constexpr int kQ4Bytes = static_cast<int>(kQ4BlockBytes);
inline constexpr int kFp8 = static_cast<int>(kFp8Block);
inline constexpr int kMxfp4 = static_cast<int>(kMxfp4Block);
static_assert(kMxfp4Block == kQ4Block && kMxfp4BlockBytes == kQ4BlockBytes, "MXFP4 and Q4 blocks share a shape");

// E2M1 (MXFP4) values by code: sign bit 8, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
inline constexpr float kE2m1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                    -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// Amx, Avx512Vnni, Avx2Int8, AvxVnni, NeonDot and NeonI8mm are opt-in: their Q4 and MXFP4 kernels quantise
// activations to int8 (kernels_amx.cpp, kernels_avx512.cpp, kernels_avx2.cpp, kernels_avx_vnni.cpp,
// kernels_neon.cpp), so none is what best_isa() returns; everything else they run is their vector ISA's
// (vector_isa). Amx runs prefills on AMX-INT8 tiles and the rest as Avx512Vnni; NeonI8mm runs prefills with
// SMMLA and the rest as NeonDot. Avx2Int8 and AvxVnni agree
// bit for bit. The others compute with float activations and agree to float rounding. x86-64 builds have
// Scalar, the Avx ones and Amx, AArch64 builds Scalar and the Neon ones.
enum class Isa : int {
  Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3, Avx2Int8 = 4, Neon = 5, NeonDot = 6, AvxVnni = 7, Amx = 8,
  NeonI8mm = 9
};

// The float ISA under an int8-activation one: what its backbone, attention and recurrent kernels run.
inline Isa vector_isa(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni:
    case Isa::Amx: return Isa::Avx512;
    case Isa::Avx2Int8:
    case Isa::AvxVnni: return Isa::Avx2;
    case Isa::NeonDot:
    case Isa::NeonI8mm: return Isa::Neon;
    default: return isa;
  }
}

// Whether an ISA has AVX-512 VNNI's vpdpbusd (the int8 attention task, attention_i8.cpp).
inline bool has_avx512_vnni(Isa isa) { return isa == Isa::Avx512Vnni || isa == Isa::Amx; }

// Y[t, r] = sum_c W[r, c] * X[t, c] for t < n, r < rows; W is one quantised projection (codes + scales).
// X rows are `ldx` floats apart, Y rows `ldy` floats apart. Every ISA sums a row in the same block order
// but with its own vector width, so ISAs agree to float rounding, not bit for bit.
struct MatvecArgs {
  const uint8_t* codes;   // codes plane
  const void* scales;     // scales plane (f16 for Q4_G32; bf16 or f32 for FP8_B128; E8M0 bytes for MXFP4_G32)
  ScaleDtype scale_dtype;
  int rows, cols;
  const float* x; int ldx;
  int n;
  float* y; int ldy;
};

using MatvecFn = void (*)(const MatvecArgs&);

struct IsaKernels {
  MatvecFn q4;
  MatvecFn fp8;
  MatvecFn mxfp4;
  MatvecFn of(QuantType quant) const {
    return quant == QuantType::Q4_G32 ? q4 : quant == QuantType::MXFP4_G32 ? mxfp4 : fp8;
  }
};

// How an expert joins its gate and up projections (the recipe's FFN activation):
//   Silu:          silu(gate) * up
//   ClampedSwiglu: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (gpt-oss)
struct ExpertActivation {
  enum class Kind : int { Silu = 0, ClampedSwiglu = 1 } kind = Kind::Silu;
  float alpha = 1.f, limit = 0.f;
};

// A vault's experts as the kernels run them: its record layout and the recipe's activation.
struct ExpertFormat {
  RecordLayout layout;
  ExpertActivation act;
  ExpertFormat() = default;
  ExpertFormat(uint32_t quant, uint32_t scale_dtype, uint32_t hidden, uint32_t intermediate, bool bias,
               int activation, float alpha, float limit);  // throws std::invalid_argument for unknown codes
};

// g[i] = act(g[i], u[i]) for i < n, in place (activation.cpp: the same bits on every ISA).
void apply_activation(const ExpertActivation& act, float* g, const float* u, uint64_t n);
// x[i] = silu(x[i]) for i < n, in place (the same bits as apply_activation's Silu with u all ones).
void apply_silu(float* x, uint64_t n);

IsaKernels scalar_kernels();
IsaKernels avx2_kernels();
IsaKernels avx512_kernels();
IsaKernels avx512_vnni_kernels();
IsaKernels avx2_int8_kernels();
IsaKernels avx_vnni_kernels();
IsaKernels amx_kernels();
IsaKernels neon_kernels();
IsaKernels neon_dot_kernels();
IsaKernels neon_i8mm_kernels();
IsaKernels kernels_for(Isa isa);  // the ISA must be this build's (isa_available)
bool isa_available(Isa isa);

// What this CPU supports, at most what MOSAIC_ISA allows: a forced path for tests and benchmarks. It names a
// float ISA (scalar, avx2, avx512 on x86-64; scalar, neon on AArch64), which caps best_isa(), or an int8 one
// (amx, avx512-vnni, avx-vnni, avx2-int8; neon-dot), which caps best_isa() at its float ISA and is int8_isa()
// where the CPU has it. An unknown MOSAIC_ISA, or one of another architecture, is reported once on stderr
// and ignored.
Isa best_isa();
// The fastest int8-activation ISA under best_isa() (Amx, Avx512Vnni, AvxVnni, Avx2Int8; NeonDot), or Scalar where
// there is none.
Isa int8_isa();
const char* isa_name(Isa isa);

// One expert's share of a layer: the tokens routed to it and their routing weights.
struct ExpertTask {
  const uint8_t* record;  // a whole record (vault_format.md §4)
  const int32_t* tokens;  // n indices into X
  const float* weights;   // n routing weights
  int n;
  int64_t slot = -1;      // the record's slot in `arrivals`, or -1 when it is already resident
};

enum class RecordStatus : int { Pending = 0, Ready = 1, Failed = 2 };

// Where records still being read announce themselves (the expert ring, expert_ring.h), so the driver can
// start on the experts that have arrived while the rest are in flight.
class Arrivals {
 public:
  virtual ~Arrivals() = default;
  virtual uint64_t epoch() const = 0;                    // changes whenever a read completes
  virtual RecordStatus status(int64_t slot) const = 0;
  virtual void wait_past(uint64_t epoch) const = 0;       // sleep until epoch() differs from `epoch`
};

// Time the driver spent, for engine.stats.
struct MoeTiming {
  double wait_s = 0;   // threads idle waiting for records, averaged over threads
  double total_s = 0;  // the whole call
};

// Y[T, H] += the routed experts' outputs. Tasks are split over `threads` threads, whole experts each, each
// thread taking the first task whose record has arrived; each task's output lands in its own scratch rows
// and is added to Y in task order, so the result never depends on the thread count or on arrival order.
// Returns -1, or the index of a task whose record failed to arrive: then Y is left untouched and the call
// returns once every other task is done. scratch: at least moe_scratch_floats(...) floats, allocated once.
// Each expert computes down(act(gate x + b_gate, up x + b_up)) + b_down, the biases when the layout has them.
int moe_experts(const RecordLayout& layout, const ExpertActivation& act, const float* x, int hidden,
                const ExpertTask* tasks, int n_tasks, float* y, float* scratch, Isa isa, int threads,
                const Arrivals* arrivals = nullptr, MoeTiming* timing = nullptr);
uint64_t moe_scratch_floats(const RecordLayout& layout, int total_rows, int max_rows_per_task, int threads);

// Y[n, rows] = X[n, cols] @ W.T with W in bf16 [rows, cols], float32 accumulation; rows over threads.
// AVX-512 or AVX2 as isa allows, else the scalar loop (the reference).
void linear_bf16(const uint16_t* w, int rows, int cols, const float* x, int n, float* y, int threads, Isa isa);

// Y[n, rows] = X[n, cols] @ W.T for W quantised per output row: codes [rows, cols] (int8, or E4M3 when
// fp8) times scales[rows], float32 activations and accumulation; rows over threads.
void linear_quant(const uint8_t* w, const float* scales, bool fp8, int rows, int cols, const float* x, int n,
                  float* y, int threads, Isa isa);

// Decode attention of one token: out[h] = softmax(scale * q[h] . K[g]^T) V[g] over keys 0..length-1, with
// g = h / (heads / kv_heads). q and out are [heads, head_dim]; K and V rows are head_dim floats, each KV
// head's rows contiguous, heads k_head_stride / v_head_stride floats apart (the paged cache's layout).
// Keys are cut into fixed chunks merged in order, so results do not depend on the thread count.
// sinks [heads] or null: query head h's softmax takes exp(sinks[h]) into its denominator (gpt-oss).
void decode_attention(const float* q, int heads, int head_dim, const float* k, const float* v, int64_t k_head_stride,
                      int64_t v_head_stride, int kv_heads, int length, float scale, float* out, int threads, Isa isa,
                      const float* sinks = nullptr);
// The same over a bf16 cache (K and V as bf16 bit patterns), widened to float32 exactly as they are read.
void decode_attention_bf16(const float* q, int heads, int head_dim, const uint16_t* k, const uint16_t* v,
                           int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int length, float scale,
                           float* out, int threads, Isa isa, const float* sinks = nullptr);
// The same over an int8 cache: key or value = code * its row's scale; k_scale / v_scale [kv_heads, length]
// floats, heads scale_head_stride apart. Under Isa::Avx512Vnni (head_dim a multiple of 32) the products are
// integer: the queries and each tile of probabilities are rounded to 16 bits (about 1e-4 of the output).
void decode_attention_i8(const float* q, int heads, int head_dim, const int8_t* k, const int8_t* v,
                         int64_t k_head_stride, int64_t v_head_stride, const float* k_scale, const float* v_scale,
                         int64_t scale_head_stride, int kv_heads, int length, float scale, float* out, int threads,
                         Isa isa, const float* sinks = nullptr);

// A prompt chunk's causal attention: q [t_count, heads, head_dim] at positions start..start+t_count-1 against
// K and V rows [0, start+t_count) of each KV head (laid out as for decode_attention), into out [t_count, heads,
// head_dim]; the decode tasks of `isa` for a block of positions at a time. float32, bf16 and int8 caches (the
// int8 rows widened to float, key or value = code * its row's scale).
void prefill_attention(const float* q, int t_count, int heads, int head_dim, const float* k, const float* v,
                       int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int start, float scale, float* out,
                       int threads, Isa isa);
void prefill_attention_bf16(const float* q, int t_count, int heads, int head_dim, const uint16_t* k,
                            const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int start,
                            float scale, float* out, int threads, Isa isa);
void prefill_attention_i8(const float* q, int t_count, int heads, int head_dim, const int8_t* k, const int8_t* v,
                          int64_t k_head_stride, int64_t v_head_stride, const float* k_scale, const float* v_scale,
                          int64_t scale_head_stride, int kv_heads, int start, float scale, float* out, int threads,
                          Isa isa);

// Y[n, rows] = X[n, cols] @ W.T for W in Q4_G32 (a vault plane's layout: codes [rows, ceil(cols/32)*16],
// f16 scales [rows, ceil(cols/32)]), through the expert kernels' Q4 matvec of `isa` (int8 activations
// under AVX-512 VNNI); rows in contiguous blocks over threads.
void linear_q4(const uint8_t* codes, const uint16_t* scales, int rows, int cols, const float* x, int n, float* y,
               int threads, Isa isa);

// Reads n bytes once, split over threads (the roofline for benchmarks); returns a checksum.
double stream_read(const uint8_t* data, uint64_t n, int threads);

// Scalar helpers shared by every ISA.
float f16_to_f32(uint16_t h);
inline float bf16_to_f32(uint16_t h) {  // exact: bf16 is float32's upper half
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
float e4m3_to_f32(uint8_t b);
inline float e8m0_to_f32(uint8_t s) {  // 2^(s - 127); 255 is NaN
  const uint32_t bits = s == 255 ? 0x7FC00000u : s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline float scale_at(const void* scales, ScaleDtype d, uint64_t i) {
  switch (d) {
    case ScaleDtype::F32: return static_cast<const float*>(scales)[i];
    case ScaleDtype::BF16: return bf16_to_f32(static_cast<const uint16_t*>(scales)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(scales)[i]);
  }
}

// The first len (< 32) weights of one block against x, unscaled, in the reference's arithmetic: how the
// vector kernels finish a row whose last block is partial. Q4: byte j holds elements j and j + 16; MXFP4:
// elements 2j and 2j + 1.
inline float q4_partial_dot(const uint8_t* block, const float* x, int len) {
  float part = 0.f;
  for (int j = 0; j < len; ++j)
    part += (static_cast<float>(j < 16 ? (block[j] & 0xF) : (block[j - 16] >> 4)) - 8.f) * x[j];
  return part;
}
inline float mxfp4_partial_dot(const uint8_t* block, const float* x, int len) {
  float part = 0.f;
  for (int j = 0; j < len; ++j) part += kE2m1[(block[j / 2] >> (4 * (j & 1))) & 0xF] * x[j];
  return part;
}

}  // namespace mosaic
