// One decode step of a Gated DeltaNet mixer (Qwen3-Next, Qwen3.5/3.6): its four input projections, the causal
// depthwise conv over the last conv_kernel inputs, L2-normed q and k, the gated delta rule on each value
// head's [key_dim, value_dim] state, the gated RMSNorm and the output projection. The torch references are
// DecoderModel.delta_net and recurrent_gated_delta_rule (mosaic_runtime/models/decoder.py, delta_rule.py).
#include <algorithm>
#include <cmath>

#include <omp.h>

#include "mosaic/decode.h"
#include "delta_rule.h"

namespace mosaic {
namespace {

// The delta rule on one value head's whole state S [dk, dv] (delta_rule.h), compiled for each vector width
// and chosen at run time.
#if defined(MOSAIC_X86)
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void delta_head_avx512(float* S, const float* q, const float* k,
                                                                             const float* v, float decay, float beta,
                                                                             int dk, int dv, float* u, float* o) {
  delta_head(S, q, k, v, decay, beta, dk, dv, u, o);
}

__attribute__((target("avx2,fma"))) void delta_head_avx2(float* S, const float* q, const float* k, const float* v,
                                                         float decay, float beta, int dk, int dv, float* u, float* o) {
  delta_head(S, q, k, v, decay, beta, dk, dv, u, o);
}
#endif

// The base ISA's vectors: SSE2 on x86-64, NEON on AArch64.
void delta_head_scalar(float* S, const float* q, const float* k, const float* v, float decay, float beta, int dk,
                       int dv, float* u, float* o) {
  delta_head(S, q, k, v, decay, beta, dk, dv, u, o);
}

// x * rsqrt(sum x^2 + 1e-6), as models/decoder.l2norm.
void l2norm(float* x, int n) {
  double ss = 0.0;
  for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss) + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

// The causal depthwise conv of every channel over [the state's K-1 inputs, this one], the window moved on
// by one, then silu (a vectorised e^x: std::exp a channel was a quarter of this loop's time).
void conv_step(const DeltaNetMixer& m, float* mixed) {
  const int C = m.channels(), K = m.conv_kernel;
  for (int c = 0; c < C; ++c) {
    const float* w = m.conv + static_cast<int64_t>(c) * K;
    float* st = m.conv_state + static_cast<int64_t>(c) * (K - 1);
    float acc = 0.f;
    for (int j = 0; j < K - 1; ++j) acc += w[j] * st[j];
    acc += w[K - 1] * mixed[c];
    if (K > 1) {
      for (int j = 0; j < K - 2; ++j) st[j] = st[j + 1];
      st[K - 2] = mixed[c];
    }
    mixed[c] = acc;
  }
  apply_silu(mixed, C);
}

}  // namespace

// Scratch: [mixed: C][z: Hv*dv][b: Hv][a: Hv][o: Hv*dv]
uint64_t delta_net_scratch_floats(const DeltaNetMixer& m) {
  const uint64_t vd = static_cast<uint64_t>(m.value_heads) * m.value_dim;
  return m.channels() + 2 * vd + 2 * static_cast<uint64_t>(m.value_heads);
}

void delta_net_step(const DeltaNetMixer& m, const float* h, float* out, float* scratch, int threads, Isa isa) {
  const int C = m.channels(), hk = m.key_heads, hv = m.value_heads, dk = m.key_dim, dv = m.value_dim;
  float* mixed = scratch;
  float* z = mixed + C;
  float* b = z + static_cast<int64_t>(hv) * dv;
  float* a = b + hv;
  float* o = a + hv;
  const BackboneMatrix* in[] = {&m.qkv, &m.z, &m.b, &m.a};
  float* const in_out[] = {mixed, z, b, a};
  project_together(in, in_out, 4, h, threads, isa);
  conv_step(m, mixed);
  float* q = mixed;                                  // [hk, dk]
  float* k = q + static_cast<int64_t>(hk) * dk;      // [hk, dk]
  float* v = k + static_cast<int64_t>(hk) * dk;      // [hv, dv]
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int g = 0; g < hk; ++g) {
    l2norm(q + static_cast<int64_t>(g) * dk, dk);
    l2norm(k + static_cast<int64_t>(g) * dk, dk);
    for (int i = 0; i < dk; ++i) q[static_cast<int64_t>(g) * dk + i] *= q_scale;
  }
  const int rep = hv / hk;  // value head j reads key head j / rep
  const Isa vec = vector_isa(isa);
#if defined(MOSAIC_X86)
  auto head = vec == Isa::Avx512 ? delta_head_avx512 : vec == Isa::Avx2 ? delta_head_avx2 : delta_head_scalar;
#else
  auto head = delta_head_scalar;
  (void)vec;
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int j = 0; j < hv; ++j) {
    float u[kMaxDeltaValueDim];
    const float beta = 1.f / (1.f + std::exp(-b[j]));
    const float decay = std::exp(m.neg_decay[j] * softplus(a[j] + m.dt_bias[j]));
    const int g = j / rep;
    head(m.recurrent + static_cast<int64_t>(j) * dk * dv, q + static_cast<int64_t>(g) * dk,
         k + static_cast<int64_t>(g) * dk, v + static_cast<int64_t>(j) * dv, decay, beta, dk, dv, u,
         o + static_cast<int64_t>(j) * dv);
    // the gated RMSNorm of this head's output
    float* oj = o + static_cast<int64_t>(j) * dv;
    rms_norm(oj, m.norm, dv, m.eps, oj);
    float* zj = z + static_cast<int64_t>(j) * dv;
    apply_silu(zj, dv);
    for (int i = 0; i < dv; ++i) oj[i] *= zj[i];
  }
  project(m.out, o, out, threads, isa);
}

}  // namespace mosaic
