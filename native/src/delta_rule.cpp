// The gated delta rule over a prompt's tokens (decode.h: gated_delta_rule). The state's columns are
// independent (delta_rule.h), so a value head's state is taken a block of kDeltaColumns columns at a time:
// the block (key_dim x kDeltaColumns floats, 16 KB at key_dim 128) sits in L1 while kTokens tokens pass
// through it, then the next block takes the same tokens, whose q and k are still in L2; heads are split over
// the threads. At a state of 128 x 128 and 64-token chunks the chunked (WY) form does as many multiply-adds per
// token as this recurrence, in small matrix products and two triangular solves; the recurrence needs no
// more than a block of the state in cache.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

#include "mosaic/decode.h"
#include "delta_rule.h"

namespace mosaic {
namespace {

constexpr int kTokens = 64;  // tokens a block takes before the next block of the head: their q and k stay in L2

// Value head `head`'s state through tokens t0..t1-1, a block of kDeltaColumns columns at a time (copied into
// Sb, key_dim * kDeltaColumns floats, so that its rows sit in L1 without conflicts; u: kDeltaColumns floats).
__attribute__((always_inline)) inline void head_over_tokens(const DeltaRuleTokens& r, int head, int t0, int t1,
                                                            float* Sb, float* u) {
  const int dk = r.key_dim, dv = r.value_dim, key_head = head / (r.value_heads / r.key_heads);
  for (int c0 = 0; c0 < dv; c0 += kDeltaColumns) {
    const int n = std::min(kDeltaColumns, dv - c0);
    float* S = r.state + static_cast<int64_t>(head) * dk * dv + c0;
    for (int64_t i = 0; i < dk; ++i) std::memcpy(Sb + i * n, S + i * dv, sizeof(float) * n);
    for (int t = t0; t < t1; ++t) {
      const int64_t qk = (static_cast<int64_t>(t) * r.key_heads + key_head) * dk;
      const int64_t tv = static_cast<int64_t>(t) * r.value_heads + head;
      const float* v = r.v + t * r.v_token_stride + static_cast<int64_t>(head) * dv + c0;
      float* o = r.out + tv * dv + c0;
      const float decay = std::exp(r.g[tv]);
      if (n == kDeltaColumns)  // the full block with its width known: the column loops unroll into registers
        delta_columns_fixed<kDeltaColumns>(Sb, kDeltaColumns, r.q + qk, r.k + qk, v, decay, r.beta[tv], dk, o);
      else
        delta_columns(Sb, n, r.q + qk, r.k + qk, v, decay, r.beta[tv], dk, n, u, o);
    }
    for (int64_t i = 0; i < dk; ++i) std::memcpy(S + i * dv, Sb + i * n, sizeof(float) * n);
  }
}

#if defined(MOSAIC_X86)
// The same loops compiled for the wider vectors, chosen at run time.
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void head_avx512(const DeltaRuleTokens& r, int head, int t0,
                                                                       int t1, float* Sb, float* u) {
  head_over_tokens(r, head, t0, t1, Sb, u);
}

__attribute__((target("avx2,fma"))) void head_avx2(const DeltaRuleTokens& r, int head, int t0, int t1, float* Sb,
                                                   float* u) {
  head_over_tokens(r, head, t0, t1, Sb, u);
}
#endif

// The base ISA's vectors: SSE2 on x86-64, NEON on AArch64.
void head_base(const DeltaRuleTokens& r, int head, int t0, int t1, float* Sb, float* u) {
  head_over_tokens(r, head, t0, t1, Sb, u);
}

}  // namespace

void gated_delta_rule(const DeltaRuleTokens& r, int threads, Isa isa) {
  const Isa vec = vector_isa(isa);
#if defined(MOSAIC_X86)
  auto run = vec == Isa::Avx512 ? head_avx512 : vec == Isa::Avx2 ? head_avx2 : head_base;
#else
  auto run = head_base;
  (void)vec;
#endif
  // Heads over the threads; each thread takes its heads' tokens kTokens at a time.
#pragma omp parallel num_threads(std::max(1, std::min(threads, r.value_heads)))
  {
    std::vector<float> scratch(static_cast<size_t>(r.key_dim) * kDeltaColumns + kDeltaColumns);
#pragma omp for schedule(static)
    for (int head = 0; head < r.value_heads; ++head)
      for (int t0 = 0; t0 < r.tokens; t0 += kTokens)
        run(r, head, t0, std::min(r.tokens, t0 + kTokens), scratch.data(),
            scratch.data() + static_cast<int64_t>(r.key_dim) * kDeltaColumns);
  }
}

}  // namespace mosaic
