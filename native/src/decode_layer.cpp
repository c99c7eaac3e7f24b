// One decode step of a Qwen3-MoE layer's attention block and router, in one call: RMSNorm, the q/k/v
// projections, q/k RMSNorm, RoPE, the KV write, decode attention, the output projection and residual,
// the post-attention RMSNorm and the router's softmax top-k. The routed experts stay with the caller
// (they run from the expert ring). The torch path of models/qwen3_moe.py is the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <omp.h>

#include "mosaic/kernels.h"

namespace mosaic {
namespace {

void rms_norm(const float* x, const float* w, int n, float eps, float* y) {
  // double: one pass, no cancellation worries over thousands of squares; 8 partial sums, so the loop is
  // not one chain of dependent adds (which made this 4.7 us of a layer's serial time).
  double part[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(x[i + j]) * x[i + j];
  double ss = 0.0;
  for (; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  for (double p : part) ss += p;
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (i = 0; i < n; ++i) y[i] = w[i] * (x[i] * inv);
}

void project(const BackboneMatrix& p, const float* x, float* y, int threads, Isa isa) {
  switch (p.kind) {
    case BackboneMatrix::Bf16:
      linear_bf16(static_cast<const uint16_t*>(p.w), p.rows, p.cols, x, 1, y, threads, isa);
      break;
    case BackboneMatrix::Q4:
      linear_q4(static_cast<const uint8_t*>(p.w), static_cast<const uint16_t*>(p.scales), p.rows, p.cols, x, 1, y,
                threads, isa);
      break;
    default:
      linear_quant(static_cast<const uint8_t*>(p.w), static_cast<const float*>(p.scales),
                   p.kind == BackboneMatrix::Fp8, p.rows, p.cols, x, 1, y, threads, isa);
  }
}

// Several matrices applied to one x (q, k and v), their rows cut into one even split over the threads in
// one parallel region: one fork and join instead of three, and no thread waits out a small matrix's tail
// alone (k and v alone ran at 0.6 of q's bandwidth). Each row's result is what project() gives.
void project_together(const BackboneMatrix* const* ps, float* const* ys, int count, const float* x, int threads,
                      Isa isa) {
  int total = 0;
  for (int i = 0; i < count; ++i) total += ps[i]->rows;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int per = ((total + nt - 1) / nt + 15) / 16 * 16;  // whole groups of 16 rows
    const int lo = std::min(total, t * per), hi = std::min(total, lo + per);
    for (int i = 0, base = 0; i < count; base += ps[i]->rows, ++i) {
      const int r0 = std::max(lo - base, 0), r1 = std::min(hi - base, ps[i]->rows);
      if (r1 <= r0) continue;
      BackboneMatrix part = *ps[i];  // rows r0..r1: its kernels run them on this thread (a nested team of 1)
      part.rows = r1 - r0;
      if (part.kind == BackboneMatrix::Q4) {
        const int64_t blocks = (part.cols + kQ4 - 1) / kQ4;
        part.w = static_cast<const uint8_t*>(part.w) + r0 * blocks * kQ4Bytes;
        part.scales = static_cast<const uint16_t*>(part.scales) + r0 * blocks;
      } else {
        part.w = static_cast<const uint8_t*>(part.w) + static_cast<int64_t>(r0) * part.cols *
                                                           (part.kind == BackboneMatrix::Bf16 ? 2 : 1);
        if (part.scales) part.scales = static_cast<const float*>(part.scales) + r0;
      }
      project(part, x, ys[i] + r0, 1, isa);
    }
  }
}

// Rotate-half RoPE of the first rot values of each head, with sin's first half negated (Rotary.at).
void rope(float* x, int heads, int d, int rot, const float* cos, const float* signed_sin) {
  const int half = rot / 2;
  for (int h = 0; h < heads; ++h) {
    float* xh = x + static_cast<int64_t>(h) * d;
    for (int i = 0; i < half; ++i) {  // the pair (i, i + half) at once: no copy, and the loop vectorizes
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * cos[i] + b * signed_sin[i];
      xh[i + half] = b * cos[i + half] + a * signed_sin[i + half];
    }
  }
}

// One key or value row x [d] into the cache at element `at` as the cache holds it, rounded as
// kv_cache.KVCache.store rounds: bf16 to nearest even (torch's conversion); int8 to code = round half to
// even of x / scale, scale = amax / 127 (kv_cache.quantize_rows), its scale at scale_at.
void store_row(const DecodeLayer& L, void* cache, int64_t at, float* scales, int64_t scale_at, const float* x, int d) {
  switch (L.kv_dtype) {
    case KvDtype::F32:
      std::memcpy(static_cast<float*>(cache) + at, x, sizeof(float) * d);
      break;
    case KvDtype::Bf16: {
      uint16_t* out = static_cast<uint16_t*>(cache) + at;
      for (int i = 0; i < d; ++i) {
        uint32_t u;
        std::memcpy(&u, &x[i], sizeof u);
        out[i] = std::isnan(x[i]) ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      }
      break;
    }
    case KvDtype::I8: {
      float amax = 0.f;
      for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / 127.0f, div = std::max(scale, 1e-30f);
      int8_t* out = static_cast<int8_t*>(cache) + at;
      for (int i = 0; i < d; ++i) out[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] / div), -127.f, 127.f));
      scales[scale_at] = scale;
      break;
    }
  }
}

}  // namespace

uint64_t decode_layer_scratch_floats(const DecodeLayer& L) {
  const int d = L.head_dim;
  return static_cast<uint64_t>(L.hidden) * 2 + static_cast<uint64_t>(L.heads) * d * 2 +
         static_cast<uint64_t>(L.kv_heads) * d * 2 + std::max(L.router.rows, 1);
}

void decode_head(const DecodeHead& head, const float* x, float* logits, float* scratch, int threads, Isa isa) {
  rms_norm(x, head.norm, head.lm_head.cols, head.eps, scratch);
  project(head.lm_head, scratch, logits, threads, isa);
}

void decode_layer(const DecodeLayer& L, float* x, float* h, int pos, const float* cos, const float* signed_sin,
                  float* topk_weights, int32_t* topk_ids, float* scratch, int threads, Isa isa) {
  const int H = L.hidden, d = L.head_dim, hq = L.heads, hkv = L.kv_heads;
  float* normed = scratch;
  float* q = normed + H;
  float* attn = q + static_cast<int64_t>(hq) * d;
  float* k = attn + static_cast<int64_t>(hq) * d;
  float* v = k + static_cast<int64_t>(hkv) * d;
  float* o = v + static_cast<int64_t>(hkv) * d;
  float* logits = o + H;

  rms_norm(x, L.input_norm, H, L.eps, normed);
  const BackboneMatrix* qkv[] = {&L.q, &L.k, &L.v};
  float* const qkv_out[] = {q, k, v};
  project_together(qkv, qkv_out, 3, normed, threads, isa);
  for (int g = 0; g < hq; ++g) rms_norm(q + static_cast<int64_t>(g) * d, L.q_norm, d, L.eps, q + static_cast<int64_t>(g) * d);
  for (int g = 0; g < hkv; ++g) rms_norm(k + static_cast<int64_t>(g) * d, L.k_norm, d, L.eps, k + static_cast<int64_t>(g) * d);
  rope(q, hq, d, L.rot_dim, cos, signed_sin);
  rope(k, hkv, d, L.rot_dim, cos, signed_sin);
  // This position's keys and values into the cache, one row per KV head, then attention over it.
  for (int g = 0; g < hkv; ++g) {
    const int64_t row = static_cast<int64_t>(pos) * d, scale_at = g * L.scale_head_stride + pos;
    store_row(L, L.k_cache, g * L.k_head_stride + row, L.k_scale, scale_at, k + static_cast<int64_t>(g) * d, d);
    store_row(L, L.v_cache, g * L.v_head_stride + row, L.v_scale, scale_at, v + static_cast<int64_t>(g) * d, d);
  }
  switch (L.kv_dtype) {
    case KvDtype::F32:
      decode_attention(q, hq, d, static_cast<const float*>(L.k_cache), static_cast<const float*>(L.v_cache),
                       L.k_head_stride, L.v_head_stride, hkv, pos + 1, L.scale, attn, threads, isa);
      break;
    case KvDtype::Bf16:
      decode_attention_bf16(q, hq, d, static_cast<const uint16_t*>(L.k_cache), static_cast<const uint16_t*>(L.v_cache),
                            L.k_head_stride, L.v_head_stride, hkv, pos + 1, L.scale, attn, threads, isa);
      break;
    case KvDtype::I8:
      decode_attention_i8(q, hq, d, static_cast<const int8_t*>(L.k_cache), static_cast<const int8_t*>(L.v_cache),
                          L.k_head_stride, L.v_head_stride, L.k_scale, L.v_scale, L.scale_head_stride, hkv, pos + 1,
                          L.scale, attn, threads, isa);
      break;
  }
  project(L.o, attn, o, threads, isa);
  for (int i = 0; i < H; ++i) x[i] += o[i];
  rms_norm(x, L.post_norm, H, L.eps, h);
  if (L.router.rows == 0) return;  // a dense layer: the caller runs its MLP on h

  // Router: softmax over every expert in float32, the top k, renormalised if the model says so.
  const int E = L.router.rows;
  project(L.router, h, logits, threads, isa);
  const float mx = *std::max_element(logits, logits + E);
  float sum = 0.f;
  for (int e = 0; e < E; ++e) sum += (logits[e] = std::exp(logits[e] - mx));
  for (int e = 0; e < E; ++e) logits[e] /= sum;
  int32_t order[1024];
  std::iota(order, order + E, 0);
  std::partial_sort(order, order + L.top_k, order + E, [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  float picked = 0.f;
  for (int j = 0; j < L.top_k; ++j) picked += logits[order[j]];
  for (int j = 0; j < L.top_k; ++j) {
    topk_ids[j] = order[j];
    topk_weights[j] = L.norm_topk_prob ? logits[order[j]] / picked : logits[order[j]];
  }
}

}  // namespace mosaic
