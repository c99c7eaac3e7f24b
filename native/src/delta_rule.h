// The gated delta rule's step for one token on columns of one value head's state (models/delta_rule.py):
// S = decay * S; u = beta * (v - S^T k); S += k u^T; o = S^T q. Columns of S are independent of each
// other, so a caller may run any span of them: the decode step a head's whole state a block of columns at a
// time (delta_head), the prefill a block of columns over every token of the prompt (delta_rule.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace mosaic {

// S: dk rows of n columns, lds floats apart; v, u and o: n values. Two passes over S, the second from
// cache, written as plain loops over the columns, which the compiler vectorises for the target of the
// function it is inlined into.
__attribute__((always_inline)) inline void delta_columns(float* __restrict S, int64_t lds, const float* __restrict q,
                                                          const float* __restrict k, const float* __restrict v,
                                                          float decay, float beta, int dk, int n, float* __restrict u,
                                                          float* __restrict o) {
  for (int j = 0; j < n; ++j) u[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    float* row = S + i * lds;
    const float ki = k[i];
    for (int j = 0; j < n; ++j) {
      row[j] *= decay;
      u[j] += row[j] * ki;
    }
  }
  for (int j = 0; j < n; ++j) {
    u[j] = (v[j] - u[j]) * beta;
    o[j] = 0.f;
  }
  for (int i = 0; i < dk; ++i) {
    float* row = S + i * lds;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < n; ++j) {
      row[j] += ki * u[j];
      o[j] += row[j] * qi;
    }
  }
}

// The columns a block of the state takes in delta_columns_fixed: its S^T k and S^T q sums in eight AVX2
// registers (the decode step's and the prefill's blocks alike).
inline constexpr int kDeltaColumns = 32;

// Eight floats as one value of the compiler's vector extension (two SSE or NEON registers, one AVX one),
// loaded and stored without alignment.
typedef float Floats8 __attribute__((vector_size(32), aligned(4)));

// The same step on W columns (a multiple of 8) of a state whose rows are lds floats apart, rearranged so that
// no sum is carried through memory: the first pass reads S once for both S^T k and S^T q (eight independent
// sums in registers), since u = beta (v - decay S^T k) and the read after the write is
// o = decay S^T q + (k . q) u; the second pass writes S = decay S + k u^T. (The loops of delta_columns keep
// u and o in memory, and every row's update stores them and loads them back.) Agrees with delta_columns to
// float rounding.
template <int W>
__attribute__((always_inline)) inline void delta_columns_fixed(float* __restrict S, int64_t lds,
                                                                const float* __restrict q,
                                                                const float* __restrict k, const float* __restrict v,
                                                                float decay, float beta, int dk,
                                                                float* __restrict o) {
  static_assert(W % 8 == 0, "whole vectors of eight floats");
  constexpr int kVectors = W / 8;
  Floats8 sk[kVectors], sq[kVectors];
  for (int j = 0; j < kVectors; ++j) sk[j] = sq[j] = Floats8{};
  float kq = 0.f;
  for (int i = 0; i < dk; ++i) {
    const Floats8* row = reinterpret_cast<const Floats8*>(S + i * lds);
    const float ki = k[i], qi = q[i];
    kq += ki * qi;
    for (int j = 0; j < kVectors; ++j) {
      sk[j] += row[j] * ki;
      sq[j] += row[j] * qi;
    }
  }
  Floats8 u[kVectors];
  for (int j = 0; j < kVectors; ++j) {
    Floats8 vj;
    std::memcpy(&vj, v + 8 * j, sizeof vj);
    u[j] = (vj - decay * sk[j]) * beta;
    const Floats8 oj = decay * sq[j] + kq * u[j];
    std::memcpy(o + 8 * j, &oj, sizeof oj);
  }
  for (int i = 0; i < dk; ++i) {
    Floats8* row = reinterpret_cast<Floats8*>(S + i * lds);
    const float ki = k[i];
    for (int j = 0; j < kVectors; ++j) row[j] = row[j] * decay + ki * u[j];
  }
}

// A value head's whole state S [dk, dv], rows dv floats apart: kDeltaColumns at a time through
// delta_columns_fixed (each block's rows still in L1 for its second pass), a ragged end through
// delta_columns. u: dv floats.
__attribute__((always_inline)) inline void delta_head(float* __restrict S, const float* __restrict q,
                                                       const float* __restrict k, const float* __restrict v,
                                                       float decay, float beta, int dk, int dv, float* __restrict u,
                                                       float* __restrict o) {
  int c0 = 0;
  for (; c0 + kDeltaColumns <= dv; c0 += kDeltaColumns)
    delta_columns_fixed<kDeltaColumns>(S + c0, dv, q, k, v + c0, decay, beta, dk, o + c0);
  if (c0 < dv) delta_columns(S + c0, dv, q, k, v + c0, decay, beta, dk, dv - c0, u, o + c0);
}

}  // namespace mosaic
