// One decode step of a layer of any recipe (decode.h): the attention mixer, the router, the shared expert
// or dense MLP. The Gated DeltaNet mixer is in decode_delta.cpp, the layer loop (with the routed experts
// from the ring) in decode_token.cpp. The torch reference is mosaic_runtime/models/decoder.py.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include <omp.h>

#include "mosaic/decode.h"

namespace mosaic {

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

BackboneMatrix row_slice(const BackboneMatrix& w, int first, int count) {
  BackboneMatrix part = w;
  part.rows = count;
  if (part.kind == BackboneMatrix::Q4) {
    const int64_t blocks = (part.cols + kQ4 - 1) / kQ4;
    part.w = static_cast<const uint8_t*>(part.w) + first * blocks * kQ4Bytes;
    part.scales = static_cast<const uint16_t*>(part.scales) + first * blocks;
  } else {
    part.w = static_cast<const uint8_t*>(part.w) + static_cast<int64_t>(first) * part.cols *
                                                       (part.kind == BackboneMatrix::Bf16 ? 2 : 1);
    if (part.scales) part.scales = static_cast<const float*>(part.scales) + first;
  }
  return part;
}

// The matrices' rows cut into one even split over the threads in one parallel region: one fork and join
// instead of one per matrix, and no thread waits out a small matrix's tail alone (k and v alone ran at
// 0.6 of q's bandwidth). Each row's result is what project() gives.
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
      // rows r0..r1: its kernels run them on this thread (a nested team of 1)
      project(row_slice(*ps[i], r0, r1 - r0), x, ys[i] + r0, 1, isa);
    }
  }
}

namespace {

float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

constexpr int kMaxGroups = 256;  // router groups (DeepSeek-V3 has 8)

// Rotate-half RoPE of the first rot values of each head, with sin's first half negated (rope.Rotary).
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

void add(float* y, const float* b, int n) {
  for (int i = 0; i < n; ++i) y[i] += b[i];
}

void clamp(float* y, int n, float limit) {
  for (int i = 0; i < n; ++i) y[i] = std::clamp(y[i], -limit, limit);
}

// One key or value row x [d] into the cache at element `at` as the cache holds it, rounded as
// kv_cache.KVCache.store rounds: bf16 to nearest even (torch's conversion); int8 to code = round half to
// even of x / scale, scale = amax / 127 (kv_cache.quantize_rows), its scale at scale_at.
void store_row(KvDtype dtype, void* cache, int64_t at, float* scales, int64_t scale_at, const float* x, int d) {
  switch (dtype) {
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

// attn [heads, d] = the queries q [heads, d] attending over `length` cache rows of layer `layer` from
// position `first` on, whatever the cache's dtype.
void attend_cache(const KvRun& kv, int layer, int first, int length, const float* q, int heads, int d,
                  int kv_heads, float scale, float* attn, int threads, Isa isa, const float* sinks = nullptr) {
  const int64_t k0 = layer * kv.k_layer_stride + static_cast<int64_t>(first) * d;
  const int64_t v0 = layer * kv.v_layer_stride + static_cast<int64_t>(first) * d;
  const int64_t s0 = layer * kv.scale_layer_stride + first;
  switch (kv.dtype) {
    case KvDtype::F32:
      decode_attention(q, heads, d, static_cast<const float*>(kv.k) + k0, static_cast<const float*>(kv.v) + v0,
                       kv.k_head_stride, kv.v_head_stride, kv_heads, length, scale, attn, threads, isa, sinks);
      break;
    case KvDtype::Bf16:
      decode_attention_bf16(q, heads, d, static_cast<const uint16_t*>(kv.k) + k0,
                            static_cast<const uint16_t*>(kv.v) + v0, kv.k_head_stride, kv.v_head_stride, kv_heads,
                            length, scale, attn, threads, isa, sinks);
      break;
    case KvDtype::I8:
      decode_attention_i8(q, heads, d, static_cast<const int8_t*>(kv.k) + k0, static_cast<const int8_t*>(kv.v) + v0,
                          kv.k_head_stride, kv.v_head_stride, kv.k_scale + s0, kv.v_scale + s0, kv.scale_head_stride,
                          kv_heads, length, scale, attn, threads, isa, sinks);
      break;
  }
}

uint64_t attention_scratch_floats(const AttentionMixer& a) {
  const uint64_t q = static_cast<uint64_t>(a.heads) * a.head_dim, kv = static_cast<uint64_t>(a.kv_heads) * a.head_dim;
  return (a.output_gate ? 2 * q : q) + q /* gate */ + 2 * kv + q /* attention */;
}

// out [hidden] = the attention mixer's output for normed input h at position pos; this position's key and
// value go into the cache first.
void attention_step(const AttentionMixer& a, int hidden, float eps, const KvRuns& runs, const float* h, int pos,
                    const float* cos, const float* signed_sin, float* out, float* scratch, int threads, Isa isa) {
  const int d = a.head_dim, hq = a.heads, hkv = a.kv_heads;
  const int64_t qn = static_cast<int64_t>(hq) * d, kn = static_cast<int64_t>(hkv) * d;
  float* qg = scratch;                         // q_proj's rows: [query | gate] per head with an output gate
  float* gate = qg + (a.output_gate ? 2 * qn : qn);
  float* k = gate + qn;
  float* v = k + kn;
  float* attn = v + kn;
  const BackboneMatrix* qkv[] = {&a.q, &a.k, &a.v};
  float* const qkv_out[] = {qg, k, v};
  project_together(qkv, qkv_out, 3, h, threads, isa);
  if (a.q_bias) add(qg, a.q_bias, a.q.rows);
  if (a.k_bias) add(k, a.k_bias, static_cast<int>(kn));
  if (a.v_bias) add(v, a.v_bias, static_cast<int>(kn));
  float* q = qg;
  if (a.output_gate) {  // gather the queries to the front, the gates apart
    for (int g = 0; g < hq; ++g) std::memcpy(gate + static_cast<int64_t>(g) * d, qg + (2 * g + 1) * static_cast<int64_t>(d),
                                             sizeof(float) * d);
    for (int g = 1; g < hq; ++g) std::memmove(q + static_cast<int64_t>(g) * d, qg + 2 * g * static_cast<int64_t>(d),
                                              sizeof(float) * d);
  }
  if (a.qk_norm == QkNorm::Projection) {
    rms_norm(q, a.q_norm, static_cast<int>(qn), eps, q);
    rms_norm(k, a.k_norm, static_cast<int>(kn), eps, k);
  } else if (a.qk_norm == QkNorm::Head) {
    for (int g = 0; g < hq; ++g) rms_norm(q + static_cast<int64_t>(g) * d, a.q_norm, d, eps, q + static_cast<int64_t>(g) * d);
    for (int g = 0; g < hkv; ++g) rms_norm(k + static_cast<int64_t>(g) * d, a.k_norm, d, eps, k + static_cast<int64_t>(g) * d);
  }
  if (a.clip_qkv > 0.f) {
    clamp(q, static_cast<int>(qn), a.clip_qkv);
    clamp(k, static_cast<int>(kn), a.clip_qkv);
    clamp(v, static_cast<int>(kn), a.clip_qkv);
  }
  rope(q, hq, d, a.rot_dim, cos, signed_sin);
  rope(k, hkv, d, a.rot_dim, cos, signed_sin);
  // This position's keys and values into the cache, one row per KV head, then attention over it (the last
  // sliding_window positions only, when windowed: the kernel reads them as a cache that starts there). In the
  // window ring, position p goes to rows p % ring and p % ring + ring, and the window starts at row lo % ring.
  const KvRun& kv = a.windowed ? runs.window : runs.full;
  const int64_t kl = a.kv_layer * kv.k_layer_stride, vl = a.kv_layer * kv.v_layer_stride;
  const int64_t sl = a.kv_layer * kv.scale_layer_stride;
  const int lo = a.sliding_window > 0 ? std::max(0, pos + 1 - a.sliding_window) : 0;
  const int64_t ring = a.windowed ? kv.rows / 2 : 0;
  const int64_t rows[2] = {a.windowed ? pos % ring : pos, a.windowed ? pos % ring + ring : -1};
  for (int64_t r : rows) {
    if (r < 0) continue;
    for (int g = 0; g < hkv; ++g) {
      const int64_t row = r * d, scale_at = sl + g * kv.scale_head_stride + r;
      store_row(kv.dtype, kv.k, kl + g * kv.k_head_stride + row, kv.k_scale, scale_at, k + static_cast<int64_t>(g) * d, d);
      store_row(kv.dtype, kv.v, vl + g * kv.v_head_stride + row, kv.v_scale, scale_at, v + static_cast<int64_t>(g) * d, d);
    }
  }
  const int first = a.windowed ? static_cast<int>(lo % ring) : lo;
  attend_cache(kv, a.kv_layer, first, pos + 1 - lo, q, hq, d, hkv, a.scale, attn, threads, isa, a.sinks);
  if (a.output_gate)
    for (int64_t i = 0; i < qn; ++i) attn[i] *= sigmoid(gate[i]);
  project(a.o, attn, out, threads, isa);
  if (a.o_bias) add(out, a.o_bias, hidden);
}

uint64_t latent_scratch_floats(const LatentMixer& m) {
  const uint64_t heads = m.heads, dl = m.latent_dim();
  return heads * (m.nope_dim + m.rope_dim) + m.q_lora_rank + dl + 2 * heads * dl + heads * m.v_dim;
}

// out [hidden] = the latent attention mixer's output for normed input h at position pos (Decoder.
// latent_attention): this position's latent row goes into the cache first, then every head attends over the
// latent rows as one KV head, its query absorbed through uk_t, its output through uv.
void latent_step(const LatentMixer& m, const KvRun& kv, const float* h, int pos, const float* cos,
                 const float* signed_sin, float* out, float* scratch, int threads, Isa isa) {
  const int H = m.heads, dq = m.nope_dim + m.rope_dim, r = m.kv_lora_rank, dl = m.latent_dim();
  float* q = scratch;                                  // [H, dq]: per head nope values, then rope
  float* qa = q + static_cast<int64_t>(H) * dq;        // [q_lora_rank]
  float* lat = qa + m.q_lora_rank;                     // [dl]: this position's latent row
  float* query = lat + dl;                             // [H, dl]: per head its latent query, then its rope
  float* attn = query + static_cast<int64_t>(H) * dl;  // [H, dl]: per head the attended latent row
  float* ov = attn + static_cast<int64_t>(H) * dl;     // [H, v_dim]
  const BackboneMatrix* in[] = {m.q_lora_rank ? &m.q_a : &m.q, &m.kv_a};
  float* const in_out[] = {m.q_lora_rank ? qa : q, lat};
  project_together(in, in_out, 2, h, threads, isa);
  if (m.q_lora_rank) {
    rms_norm(qa, m.q_a_norm, m.q_lora_rank, m.eps, qa);
    project(m.q_b, qa, q, threads, isa);
  }
  rms_norm(lat, m.kv_a_norm, r, m.eps, lat);
  rope(lat + r, 1, m.rope_dim, m.rope_dim, cos, signed_sin);
  rope(q + m.nope_dim, H, dq, m.rope_dim, cos, signed_sin);  // each head's rope values, dq apart
#pragma omp parallel for num_threads(std::min(threads, H)) schedule(static)
  for (int g = 0; g < H; ++g) {
    const float* qg = q + static_cast<int64_t>(g) * dq;
    float* query_g = query + static_cast<int64_t>(g) * dl;
    project(row_slice(m.uk_t, g * r, r), qg, query_g, 1, isa);
    std::memcpy(query_g + r, qg + m.nope_dim, sizeof(float) * m.rope_dim);
  }
  // The latent row is key and value alike: a shared cache's V run is its K run (kv_cache.KVCache), so
  // the row is stored once and attention reads it as both.
  store_row(kv.dtype, kv.k, m.kv_layer * kv.k_layer_stride + static_cast<int64_t>(pos) * dl, kv.k_scale,
            m.kv_layer * kv.scale_layer_stride + pos, lat, dl);
  attend_cache(kv, m.kv_layer, 0, pos + 1, query, H, dl, 1, m.scale, attn, threads, isa);
#pragma omp parallel for num_threads(std::min(threads, H)) schedule(static)
  for (int g = 0; g < H; ++g)
    project(row_slice(m.uv, g * m.v_dim, m.v_dim), attn + static_cast<int64_t>(g) * dl,
            ov + static_cast<int64_t>(g) * m.v_dim, 1, isa);
  project(m.o, ov, out, threads, isa);
}

// The router's top-k of h: scores (softmax or sigmoid of the logits), the experts chosen by score + bias
// among the best groups, their scores as weights (renormalised, scaled). routing.route is the reference.
void route(const Router& r, const float* h, float* topk_weights, int32_t* topk_ids, float* scratch, int threads,
           Isa isa) {
  const int E = r.gate.rows;
  float* scores = scratch;
  float* choice = scores + E;
  project(r.gate, h, scores, threads, isa);
  if (r.logit_bias)
    for (int e = 0; e < E; ++e) scores[e] += r.logit_bias[e];
  if (r.scoring == Scoring::Softmax) {
    const float mx = *std::max_element(scores, scores + E);
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += (scores[e] = std::exp(scores[e] - mx));
    for (int e = 0; e < E; ++e) scores[e] /= sum;
  } else {
    for (int e = 0; e < E; ++e) scores[e] = sigmoid(scores[e]);
  }
  for (int e = 0; e < E; ++e) choice[e] = r.score_bias ? scores[e] + r.score_bias[e] : scores[e];
  thread_local std::vector<int32_t> order;
  order.resize(E);
  if (r.method != TopkMethod::Greedy && r.n_group > 1) {  // only the best topk_group groups compete
    const int per = E / r.n_group;
    float group_worth[kMaxGroups];
    for (int g = 0; g < r.n_group; ++g) {
      const float* c = choice + static_cast<int64_t>(g) * per;
      if (r.method == TopkMethod::NoauxTc) {  // the sum of its two best
        float a = -INFINITY, b = -INFINITY;
        for (int e = 0; e < per; ++e) {
          if (c[e] > a) b = a, a = c[e];
          else if (c[e] > b) b = c[e];
        }
        group_worth[g] = a + (per > 1 ? b : 0.f);
      } else {
        group_worth[g] = *std::max_element(c, c + per);
      }
    }
    int groups[kMaxGroups];
    std::iota(groups, groups + r.n_group, 0);
    std::partial_sort(groups, groups + r.topk_group, groups + r.n_group, [&](int a, int b) {
      return group_worth[a] > group_worth[b] || (group_worth[a] == group_worth[b] && a < b);
    });
    bool keep[kMaxGroups] = {};
    for (int g = 0; g < r.topk_group; ++g) keep[groups[g]] = true;
    for (int e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + r.top_k, order.end(), [&](int32_t a, int32_t b) {
    return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
  });
  float picked = 0.f;
  for (int j = 0; j < r.top_k; ++j) picked += scores[order[j]];
  const float denom = !r.norm_topk_prob ? 1.f : picked + (r.scoring == Scoring::Sigmoid ? 1e-20f : 0.f);
  for (int j = 0; j < r.top_k; ++j) {
    topk_ids[j] = order[j];
    topk_weights[j] = (r.norm_topk_prob ? scores[order[j]] / denom : scores[order[j]]) * r.scaling;
  }
}

}  // namespace

// Scratch: [normed: H][mixer output: H][work], the work area shared in turn by the mixer, the router and
// the MLP.
uint64_t decode_layer_scratch_floats(const DecodeLayer& L) {
  const uint64_t mixer = L.mixer == DecodeLayer::DeltaNet ? delta_net_scratch_floats(L.delta)
                         : L.mixer == DecodeLayer::Latent ? latent_scratch_floats(L.latent)
                                                          : attention_scratch_floats(L.attention);
  const uint64_t router = 2 * static_cast<uint64_t>(L.ffn.router.gate.rows);
  const uint64_t mlp = 2 * static_cast<uint64_t>(L.ffn.gate.rows) + L.hidden + 1;
  return 2 * static_cast<uint64_t>(L.hidden) + std::max({mixer, router, mlp});
}

// x += the layer's mixer; h = post-attention norm of x; the router's top-k. The shared expert or dense MLP
// is decode_mlp's, the routed experts the caller's (decode_layers).
void decode_mixer(const DecodeLayer& L, const KvRuns& kv, float* x, float* h, int pos, const float* cos,
                  const float* signed_sin, float* topk_weights, int32_t* topk_ids, float* scratch, int threads,
                  Isa isa) {
  const int H = L.hidden;
  float* normed = scratch;
  float* out = normed + H;
  float* work = out + H;
  rms_norm(x, L.input_norm, H, L.eps, normed);
  switch (L.mixer) {
    case DecodeLayer::DeltaNet: delta_net_step(L.delta, normed, out, work, threads, isa); break;
    case DecodeLayer::Latent: latent_step(L.latent, kv.full, normed, pos, cos, signed_sin, out, work, threads, isa); break;
    default: attention_step(L.attention, H, L.eps, kv, normed, pos, cos, signed_sin, out, work, threads, isa);
  }
  add(x, out, H);
  rms_norm(x, L.post_norm, H, L.eps, h);
  const Ffn& f = L.ffn;
  if (f.router.gate.rows) route(f.router, h, topk_weights, topk_ids, work, threads, isa);
}

// x += the shared expert or dense MLP of h (nothing for an MoE layer without one).
void decode_mlp(const DecodeLayer& L, const float* h, float* x, float* scratch, int threads, Isa isa) {
  const Ffn& f = L.ffn;
  if (f.gate.rows == 0) return;
  const int H = L.hidden, I = f.gate.rows;
  float* g = scratch + 2 * static_cast<int64_t>(H);  // the work area of decode_mixer's scratch layout
  float* u = g + I;
  float* y = u + I;
  const BackboneMatrix* gu[] = {&f.gate, &f.up};
  float* const gu_out[] = {g, u};
  project_together(gu, gu_out, 2, h, threads, isa);
  apply_activation(ExpertActivation{}, g, u, I);  // silu(g) * u
  project(f.down, g, y, threads, isa);
  float s = 1.f;
  if (f.shared_gate.rows) {
    project(f.shared_gate, h, y + H, 1, isa);
    s = sigmoid(y[H]);
  }
  for (int i = 0; i < H; ++i) x[i] += s * y[i];
}

void decode_head(const DecodeHead& head, const float* x, float* logits, float* scratch, int threads, Isa isa) {
  rms_norm(x, head.norm, head.lm_head.cols, head.eps, scratch);
  project(head.lm_head, scratch, logits, threads, isa);
}

}  // namespace mosaic
