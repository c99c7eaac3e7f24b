// The experts' activations between their gate/up and down projections: g[i] = act(g[i], u[i]); and silu
// alone, for the recurrent hybrids' conv and output gate.
//
// std::exp is a call per element (3 ns here, 3-4 % of a prefill expert's time at Qwen3-30B's shapes). Here e^x
// is a polynomial with no branch and no call, so the loops vectorise, and the file is built with
// -fno-trapping-math (the clamps' compares may then run as blends) and -ffp-contract=off: every target below
// rounds the same multiplies and adds, so each element's bits are the same whichever one runs.
#include <cstdint>
#include <cstring>

#include "mosaic/kernels.h"

#if defined(MOSAIC_X86)
#include "simd_avx2.h"
#include "simd_avx512.h"
#endif

namespace mosaic {
namespace {

// e^x within 1e-7 relative (Cephes' expf polynomial on x - n ln 2, n the nearest integer to x log2 e) for x
// in [-87.3, 88], the bounds outside it, NaN for NaN.
[[gnu::always_inline]] inline float exp_poly(float x) {
  x = x < -87.3f ? -87.3f : x > 88.f ? 88.f : x;        // NaN fails both compares and stays NaN
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // rounds to an integer (1.5 x 2^23)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts: r exact enough
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.f) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

[[gnu::always_inline]] inline void activation(const ExpertActivation& act, float* g, const float* u, uint64_t n) {
  if (act.kind == ExpertActivation::Kind::Silu) {
    for (uint64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + exp_poly(-g[i])) * u[i];
    return;
  }
  const float lim = act.limit, alpha = act.alpha;
  for (uint64_t i = 0; i < n; ++i) {
    const float gi = g[i] > lim ? lim : g[i];  // NaN stays NaN, as under torch.clamp
    const float ui = u[i] < -lim ? -lim : u[i] > lim ? lim : u[i];
    g[i] = (ui + 1.f) * (gi / (1.f + exp_poly(-alpha * gi)));
  }
}

// x[i] = silu(x[i]) for i < n: the Silu activation's bits with an up projection of ones.
[[gnu::always_inline]] inline void silu(float* x, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + exp_poly(-x[i]));
}

struct ActivationFns {
  void (*activation)(const ExpertActivation&, float*, const float*, uint64_t);
  void (*silu)(float*, uint64_t);
};

void activation_baseline(const ExpertActivation& act, float* g, const float* u, uint64_t n) {
  activation(act, g, u, n);
}
void silu_baseline(float* x, uint64_t n) { silu(x, n); }

#if defined(MOSAIC_X86)
MOSAIC_AVX2 void activation_avx2(const ExpertActivation& act, float* g, const float* u, uint64_t n) {
  activation(act, g, u, n);
}
MOSAIC_AVX2 void silu_avx2(float* x, uint64_t n) { silu(x, n); }
MOSAIC_AVX512 void activation_avx512(const ExpertActivation& act, float* g, const float* u, uint64_t n) {
  activation(act, g, u, n);
}
MOSAIC_AVX512 void silu_avx512(float* x, uint64_t n) { silu(x, n); }
#endif

ActivationFns widest() {
#if defined(MOSAIC_X86)
  switch (best_isa()) {
    case Isa::Avx512: return {activation_avx512, silu_avx512};
    case Isa::Avx2: return {activation_avx2, silu_avx2};
    default: break;
  }
#endif
  return {activation_baseline, silu_baseline};
}

const ActivationFns& fns() {
  static const ActivationFns run = widest();
  return run;
}

}  // namespace

void apply_activation(const ExpertActivation& act, float* g, const float* u, uint64_t n) {
  fns().activation(act, g, u, n);
}

void apply_silu(float* x, uint64_t n) { fns().silu(x, n); }

}  // namespace mosaic
