// Decode attention: one new token's query heads against every cached key and value, read once; and a
// prompt chunk's causal attention through the same tasks (attend_prompt).
//
// The query heads that share a KV head are served together, so each key and value row is read from
// memory once for all of them (GQA). Keys are cut into fixed chunks of kChunk; each (KV head, chunk) is a
// task with its own reference max, sum and output (online softmax, flash-decoding), and the chunks are
// merged in ascending order: the result depends on the length only, never on the thread count.
// Caches: float32, bf16, or int8 with a float32 scale per row (key or value = code * scale); under an ISA
// with AVX-512 VNNI (Avx512Vnni, Amx) an int8 cache takes the integer task of attention_i8.cpp instead. AVX2
// and NEON CPUs take the AVX-512 task's plan at eight and four lanes, in the same chunks. The tasks are per
// ISA (attention_task.h); this file holds the driver, the scalar task (the reference) and the merge.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "mosaic/kernels.h"
#include "attention_task.h"

namespace mosaic {
namespace {

using namespace attention;

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }  // times its row's scale, by the caller
inline float widen(uint16_t x) { return bf16_to_f32(x); }

template <typename T>
void task_scalar(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1, float* o,
                 Partial* part) {
  std::vector<float> s(k1 - k0);
  for (int r = 0; r < rep; ++r) {
    const float* qr = q + static_cast<int64_t>(r) * d;
    float m = -std::numeric_limits<float>::infinity();
    for (int j = k0; j < k1; ++j) {
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot += qr[i] * widen(k[static_cast<int64_t>(j) * d + i]);
      if (rs.k) dot *= rs.k[j];
      s[j - k0] = dot;
      m = std::max(m, dot);
    }
    float l = 0.f;
    float* orow = o + static_cast<int64_t>(r) * d;
    std::fill(orow, orow + d, 0.f);
    for (int j = k0; j < k1; ++j) {
      const float p = std::exp(s[j - k0] - m);
      l += p;
      const float pv = rs.v ? p * rs.v[j] : p;
      for (int i = 0; i < d; ++i) orow[i] += pv * widen(v[static_cast<int64_t>(j) * d + i]);
    }
    part[r] = {m, l};
  }
}

// Which task a driver hands a (query rows, key range) to under `isa`, and where that task keeps element i of
// a query or output row: the AVX-512 task reads bf16 rows as evens then odds inside each block of 32
// (load_pair), so its bf16 query and output rows go in that order; the others in place.
template <typename T>
struct TaskChoice {
  static constexpr bool bf16 = std::is_same<T, uint16_t>::value, int8 = std::is_same<T, int8_t>::value;
  int d;
  bool wide, avx2, neon, split;
  TaskChoice(Isa isa, int d)
      : d(d),
        // bf16 and int8 rows are loaded 32 values at a time (load_pair, attention_i8.cpp)
        wide(vector_isa(isa) == Isa::Avx512 && d % (int8 || bf16 ? 32 : 16) == 0),
        // the AVX2 task also serves AVX-512 CPUs for the head sizes the wide task does not take
        avx2(!wide && vector_isa(isa) != Isa::Scalar && d % 8 == 0),
        neon(vector_isa(isa) == Isa::Neon && d % 8 == 0),
        split(bf16 && wide) {}
  int at(int i) const { return split ? (i & ~31) + (i & 1) * 16 + (i & 31) / 2 : i; }
  void run(const float* q, int n, const T* k, const T* v, RowScales rs, int k0, int k1, float* o,
           Partial* part) const {
#if defined(MOSAIC_X86)
    if (wide) return task_avx512(q, n, d, k, v, rs, k0, k1, o, part);
    if (avx2) return task_avx2(q, n, d, k, v, rs, k0, k1, o, part);
#elif defined(MOSAIC_ARM)
    if (neon) return task_neon(q, n, d, k, v, rs, k0, k1, o, part);
#endif
    task_scalar(q, n, d, k, v, rs, k0, k1, o, part);
  }
};

template <typename T>
void attend(const float* q, int heads, int head_dim, const T* k, const T* v, int64_t k_head_stride,
            int64_t v_head_stride, const float* k_scale, const float* v_scale, int64_t scale_head_stride,
            int kv_heads, int length, float scale, float* out, int threads, Isa isa, const float* sinks) {
  const int rep = heads / kv_heads, d = head_dim;
  const int chunks = std::max(1, (length + kChunk - 1) / kChunk);
  // A KV head's query heads go to a task kMaxRep or fewer at a time (latent attention has 128 on one):
  // `sub` tasks of up to `per` heads each, every one reading the chunk's keys and values.
  const int sub = (rep + kMaxRep - 1) / kMaxRep, per = (rep + sub - 1) / sub;
  const int tasks = kv_heads * sub * chunks;
  const TaskChoice<T> choice(isa, d);
  const bool integer = TaskChoice<T>::int8 && choice.wide && has_avx512_vnni(isa) && d <= kMaxDim;  // task_i8_vnni
  // the integer int8 task keeps its outputs in i8_order
  auto out_at = [&choice, integer](int i) { return integer ? (i & ~31) + i8_order(i & 31) : choice.at(i); };
  thread_local std::vector<float> o_buf, q_buf;
  thread_local std::vector<int16_t> q16_buf;
  thread_local std::vector<Partial> part_buf;
  if (integer) {  // each query head as int16 codes, its largest magnitude at 32767, and its scale
    q16_buf.resize(static_cast<size_t>(heads) * d);
    q_buf.resize(heads);
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + static_cast<size_t>(h) * d;
      float amax = 0.f;
      for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(qh[i]));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int i = 0; i < d; ++i) q16_buf[static_cast<size_t>(h) * d + i] = static_cast<int16_t>(std::nearbyint(qh[i] * inv));
      q_buf[h] = amax / 32767.f * scale;
    }
  } else {  // the queries times scale: what every task dots with
    q_buf.resize(static_cast<size_t>(heads) * d);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d; ++i) q_buf[static_cast<size_t>(h) * d + choice.at(i)] = q[static_cast<size_t>(h) * d + i] * scale;
  }
  [[maybe_unused]] const int16_t* q16 = q16_buf.data();  // the integer task's (x86 only)
  const float* qf = q_buf.data();
  o_buf.resize(static_cast<size_t>(tasks) * per * d);
  part_buf.resize(static_cast<size_t>(tasks) * per);
  float* o_all = o_buf.data();
  Partial* part_all = part_buf.data();
#pragma omp parallel for num_threads(std::min(threads, tasks)) schedule(static)
  for (int t = 0; t < tasks; ++t) {
    const int g = t / (sub * chunks), r0 = (t / chunks) % sub * per, c = t % chunks;
    const int n = std::min(per, rep - r0);  // this task's query heads: r0.. of KV head g
    const int k0 = c * kChunk, k1 = std::min(length, k0 + kChunk);
    const int64_t h0 = static_cast<int64_t>(g) * rep + r0;  // its first query head
    const float* qg = qf + h0 * d;
    float* o = o_all + static_cast<int64_t>(t) * per * d;
    Partial* part = part_all + static_cast<int64_t>(t) * per;
    const T* kg = k + g * k_head_stride;
    const T* vg = v + g * v_head_stride;
    const RowScales rs{k_scale ? k_scale + g * scale_head_stride : nullptr,
                       v_scale ? v_scale + g * scale_head_stride : nullptr};
#if defined(MOSAIC_X86)
    if constexpr (TaskChoice<T>::int8) {
      if (integer) {
        task_i8_vnni(q16 + h0 * d, qf + h0, n, d, kg, vg, rs, k0, k1, o, part);
        continue;
      }
    }
#endif
    choice.run(qg, n, kg, vg, rs, k0, k1, o, part);
  }
  // Merge each query head's chunks in ascending order, in the kernel's element order (a loop that
  // vectorizes), then put the elements back in place. A sink is one more logit in the denominator.
  const int rows = kv_heads * rep;
#pragma omp parallel for num_threads(std::min(threads, rows)) schedule(static)
  for (int row = 0; row < rows; ++row) {
    const int g = row / rep, s = row % rep / per, r = row % rep % per;  // head r of task group (g, s)
    const int t0 = (g * sub + s) * chunks;                                // its chunks' tasks: t0..
    float m = sinks ? sinks[row] : -std::numeric_limits<float>::infinity();
    for (int c = 0; c < chunks; ++c) m = std::max(m, part_all[(t0 + c) * per + r].ref);
    std::vector<float> acc(d, 0.f);
    float l = sinks ? std::exp(sinks[row] - m) : 0.f;
    for (int c = 0; c < chunks; ++c) {
      const int t = t0 + c;
      const float w = std::exp(part_all[t * per + r].ref - m);
      l += part_all[t * per + r].sum * w;
      const float* o = o_all + (static_cast<int64_t>(t) * per + r) * d;
      for (int i = 0; i < d; ++i) acc[i] += o[i] * w;
    }
    const float inv = 1.f / l;
    float* dst = out + static_cast<int64_t>(row) * d;
    for (int i = 0; i < d; ++i) dst[i] = acc[out_at(i)] * inv;
  }
}

// A prompt chunk's causal attention, T queries at positions start..start+T-1 over keys [0, start+T), through
// the decode tasks. A task takes the query heads of one KV head for a block of consecutive positions (up to
// kMaxRep rows), so each key tile it loads serves every row: first over the keys all of the block's positions
// see ([0, start + p0), in chunks of kChunk), then each position alone over the block's own keys up to itself.
// A work item is one (block, KV head, group of query heads); its partial results are merged in that fixed
// order, so the output does not depend on the thread count. The tasks widen bf16 and int8 rows as they read
// them (no integer task here: a prompt's queries go in float).
template <typename T>
void attend_prompt(const float* q, int t_count, int heads, int d, const T* k, const T* v, int64_t k_head_stride,
                   int64_t v_head_stride, const float* k_scale, const float* v_scale, int64_t scale_head_stride,
                   int kv_heads, int start, float scale, float* out, int threads, Isa isa) {
  const int rep = heads / kv_heads;
  const int sub = (rep + kMaxRep - 1) / kMaxRep, per = (rep + sub - 1) / sub;  // query heads an item takes
  const int span = std::max(1, kMaxRep / per);                                  // positions a block takes
  const int blocks = (t_count + span - 1) / span, items = blocks * kv_heads * sub;
  const TaskChoice<T> choice(isa, d);
#pragma omp parallel num_threads(std::max(1, std::min(threads, items)))
  {
    std::vector<float> qb(static_cast<size_t>(kMaxRep) * d), acc(qb.size()), o(qb.size());
    std::vector<Partial> part(kMaxRep), total(kMaxRep);
    // Adds a task's rows [r0, r0 + n) to the running result, each rescaled to the larger reference.
    auto merge = [&](int r0, int n) {
      for (int r = r0; r < r0 + n; ++r) {
        const Partial p = part[r - r0], t = total[r];
        const float m = std::max(t.ref, p.ref);
        const float a = t.sum > 0.f ? std::exp(t.ref - m) : 0.f, b = std::exp(p.ref - m);
        float* accr = acc.data() + static_cast<int64_t>(r) * d;
        const float* orow = o.data() + static_cast<int64_t>(r - r0) * d;
        for (int i = 0; i < d; ++i) accr[i] = accr[i] * a + orow[i] * b;
        total[r] = {m, t.sum * a + p.sum * b};
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; ++item) {
      // the last blocks, which see the most keys, first
      const int b = blocks - 1 - item / (kv_heads * sub), g = item / sub % kv_heads, h0 = item % sub * per;
      const int n = std::min(per, rep - h0), p0 = b * span, np = std::min(span, t_count - p0), rows = np * n;
      for (int pi = 0; pi < np; ++pi)
        for (int r = 0; r < n; ++r) {
          const float* src = q + (static_cast<int64_t>(p0 + pi) * heads + g * rep + h0 + r) * d;
          float* dst = qb.data() + static_cast<int64_t>(pi * n + r) * d;
          for (int i = 0; i < d; ++i) dst[choice.at(i)] = src[i] * scale;
        }
      std::fill(acc.begin(), acc.begin() + static_cast<int64_t>(rows) * d, 0.f);
      std::fill(total.begin(), total.begin() + rows, Partial{-std::numeric_limits<float>::infinity(), 0.f});
      const T* kg = k + g * k_head_stride;
      const T* vg = v + g * v_head_stride;
      const RowScales rs{k_scale ? k_scale + g * scale_head_stride : nullptr,
                         v_scale ? v_scale + g * scale_head_stride : nullptr};
      const int shared = start + p0;  // keys every position of the block sees
      for (int k0 = 0; k0 < shared; k0 += kChunk) {
        choice.run(qb.data(), rows, kg, vg, rs, k0, std::min(shared, k0 + kChunk), o.data(), part.data());
        merge(0, rows);
      }
      for (int pi = 0; pi < np; ++pi) {  // the block's own keys, up to each position
        choice.run(qb.data() + static_cast<int64_t>(pi) * n * d, n, kg, vg, rs, shared, shared + pi + 1, o.data(),
                  part.data());
        merge(pi * n, n);
      }
      for (int pi = 0; pi < np; ++pi)
        for (int r = 0; r < n; ++r) {
          const int row = pi * n + r;
          const float inv = 1.f / total[row].sum;
          const float* src = acc.data() + static_cast<int64_t>(row) * d;
          float* dst = out + (static_cast<int64_t>(p0 + pi) * heads + g * rep + h0 + r) * d;
          for (int i = 0; i < d; ++i) dst[i] = src[choice.at(i)] * inv;
        }
    }
  }
}

}  // namespace

void prefill_attention(const float* q, int t_count, int heads, int head_dim, const float* k, const float* v,
                       int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int start, float scale, float* out,
                       int threads, Isa isa) {
  attend_prompt(q, t_count, heads, head_dim, k, v, k_head_stride, v_head_stride, nullptr, nullptr, 0, kv_heads, start,
                scale, out, threads, isa);
}

void prefill_attention_bf16(const float* q, int t_count, int heads, int head_dim, const uint16_t* k,
                            const uint16_t* v, int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int start,
                            float scale, float* out, int threads, Isa isa) {
  attend_prompt(q, t_count, heads, head_dim, k, v, k_head_stride, v_head_stride, nullptr, nullptr, 0, kv_heads, start,
                scale, out, threads, isa);
}

void prefill_attention_i8(const float* q, int t_count, int heads, int head_dim, const int8_t* k, const int8_t* v,
                          int64_t k_head_stride, int64_t v_head_stride, const float* k_scale, const float* v_scale,
                          int64_t scale_head_stride, int kv_heads, int start, float scale, float* out, int threads,
                          Isa isa) {
  attend_prompt(q, t_count, heads, head_dim, k, v, k_head_stride, v_head_stride, k_scale, v_scale, scale_head_stride,
                kv_heads, start, scale, out, threads, isa);
}

void decode_attention(const float* q, int heads, int head_dim, const float* k, const float* v, int64_t k_head_stride,
                      int64_t v_head_stride, int kv_heads, int length, float scale, float* out, int threads, Isa isa,
                      const float* sinks) {
  attend(q, heads, head_dim, k, v, k_head_stride, v_head_stride, nullptr, nullptr, 0, kv_heads, length, scale, out,
         threads, isa, sinks);
}

void decode_attention_bf16(const float* q, int heads, int head_dim, const uint16_t* k, const uint16_t* v,
                           int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int length, float scale,
                           float* out, int threads, Isa isa, const float* sinks) {
  attend(q, heads, head_dim, k, v, k_head_stride, v_head_stride, nullptr, nullptr, 0, kv_heads, length, scale, out,
         threads, isa, sinks);
}

void decode_attention_i8(const float* q, int heads, int head_dim, const int8_t* k, const int8_t* v,
                         int64_t k_head_stride, int64_t v_head_stride, const float* k_scale, const float* v_scale,
                         int64_t scale_head_stride, int kv_heads, int length, float scale, float* out, int threads,
                         Isa isa, const float* sinks) {
  attend(q, heads, head_dim, k, v, k_head_stride, v_head_stride, k_scale, v_scale, scale_head_stride, kv_heads,
         length, scale, out, threads, isa, sinks);
}

}  // namespace mosaic
