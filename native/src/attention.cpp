// Decode attention: one new token's query heads against every cached key and value, read once.
//
// The query heads that share a KV head are served together, so each key and value row is read from
// memory once for all of them (GQA). Keys are cut into fixed chunks of kChunk; each (KV head, chunk) is a
// task with its own reference max, sum and output (online softmax, flash-decoding), and the chunks are
// merged in ascending order: the result depends on the length only, never on the thread count.
// Caches: float32, bf16, or int8 with a float32 scale per row (key or value = code * scale); under
// Isa::Avx512Vnni an int8 cache takes the integer task of attention_i8.cpp instead. AVX2 CPUs take a
// simpler task (task_avx2) in the same chunks.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "mosaic/kernels.h"
#include "attention_tile.h"

namespace mosaic {
namespace {

using namespace attention;

constexpr int kAhead = 1;  // tiles prefetched ahead (16 KB of float32 at head_dim 256)

// The next tile's key and value lines, prefetched towards L1 a few at a time from inside the arithmetic
// (step() once an inner iteration), so memory streams behind the compute. A burst of prefetches would
// fill the core's dozen line-fill buffers and stall it, and with no prefetch the stream idles whenever
// the loop works from L1. Prefetching past the end of the cache is harmless: prefetches never fault.
struct Prefetcher {
  const char* k;
  const char* v;
  int lines;     // 64-byte lines in one tile of K (the same of V)
  int per_step;  // lines a step
  int done = 0;
  inline void step() {
    for (int i = 0; i < per_step && done < 2 * lines; ++i, ++done)
      _mm_prefetch(done < lines ? k + 64 * static_cast<int64_t>(done) : v + 64 * static_cast<int64_t>(done - lines),
                   _MM_HINT_T0);
  }
};

inline float widen(float x) { return x; }
inline float widen(int8_t x) { return static_cast<float>(x); }  // times its row's scale, by the caller
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Slices 2i and 2i+1 (16 floats each) of a cached row, in the kernel's order.
// float32: the row's values 32i..32i+15 and 32i+16..32i+31, in place.
// bf16: one 64-byte load of 32 values. A bf16 is a float's top half, so the even-indexed values are the
// 32-bit lanes shifted left by 16 and the odd-indexed ones the lanes with their low half cleared: one
// integer op a slice, no shuffle and no widened copy. Inside each block of 32 the kernel's order is then
// evens, odds; attend lays the queries out the same way and puts the outputs back.
MOSAIC_AVX512 inline void load_pair(const float* row, int i, __m512& s0, __m512& s1) {
  s0 = _mm512_loadu_ps(row + 32 * i);
  s1 = _mm512_loadu_ps(row + 32 * i + 16);
}
MOSAIC_AVX512 inline void load_pair(const int8_t* row, int i, __m512& s0, __m512& s1) {  // codes, in place
  s0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * i))));
  s1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * i + 16))));
}
MOSAIC_AVX512 inline void load_pair(const uint16_t* row, int i, __m512& s0, __m512& s1) {
  const __m512i w = _mm512_loadu_si512(row + 32 * i);
  s0 = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  s1 = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Scores of HB query heads (q, rows d apart, in the kernel's order) against 4 key rows, over the nv
// slices of a row: each loaded key slice feeds HB heads and each query slice 4 keys, so a multiply-add
// costs 1/HB + 1/4 loads from L1 instead of 1 or 2. L1 loads, not the FMA units, bound these loops (about
// one 64-byte load a cycle measured here). Leaves the HB x 4 lane-partial sums in a[h * kTile + j].
template <int HB, typename T>
MOSAIC_AVX512 inline void score_block(const float* q, int d, int nv, const T* const* krow, __m512* a,
                                      Prefetcher& pf) {
  __m512 acc[HB][4];
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
  for (int i = 0; i + 2 <= nv; i += 2) {
    __m512 k0[4], k1[4];
    for (int j = 0; j < 4; ++j) load_pair(krow[j], i / 2, k0[j], k1[j]);
    pf.step();
    for (int h = 0; h < HB; ++h) {
      const __m512 q0 = _mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * i);
      const __m512 q1 = _mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * i + 16);
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(q1, k1[j], _mm512_fmadd_ps(q0, k0[j], acc[h][j]));
    }
  }
  if constexpr (std::is_same<T, float>::value) {
    if (nv % 2) {  // an odd last slice (head_dim 80, 112, ...); bf16 rows come in whole pairs
      for (int j = 0; j < 4; ++j) {
        const __m512 kv = _mm512_loadu_ps(krow[j] + 16 * (nv - 1));
        for (int h = 0; h < HB; ++h)
          acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q + static_cast<int64_t>(h) * d + 16 * (nv - 1)), kv, acc[h][j]);
      }
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int j = 0; j < 4; ++j) a[h * kTile + j] = acc[h][j];
}

// o[h] += sum_j p[h][j] v[j] for HB heads over S slices of their output rows from slice i0
// (even when S is), over the n value rows of a tile: each loaded value slice feeds HB heads.
template <int HB, int S, typename T>
MOSAIC_AVX512 inline void value_block(float* o, int d, int i0, const float (*p)[kTile], const T* vt, int n,
                                      Prefetcher& pf) {
  __m512 acc[HB][S];
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s)
      acc[h][s] = _mm512_loadu_ps(o + static_cast<int64_t>(h) * d + 16 * (i0 + s));
  for (int j = 0; j < n; ++j) {
    const T* vr = vt + static_cast<int64_t>(j) * d;
    pf.step();
    __m512 vv[S];
    if constexpr (S == 1) vv[0] = _mm512_loadu_ps(vr + 16 * i0);  // float32 only
    else
      for (int s = 0; s < S; s += 2) load_pair(vr, (i0 + s) / 2, vv[s], vv[s + 1]);
    for (int h = 0; h < HB; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h][j]);
      for (int s = 0; s < S; ++s) acc[h][s] = _mm512_fmadd_ps(ph, vv[s], acc[h][s]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int s = 0; s < S; ++s) _mm512_storeu_ps(o + static_cast<int64_t>(h) * d + 16 * (i0 + s), acc[h][s]);
}

// The value phase of one head block (HB heads): every slice of their output rows, 4 at a time.
template <int HB, typename T>
MOSAIC_AVX512 inline void value_rows(float* o, int d, int nv, const float (*p)[kTile], const T* vt, int n,
                                     Prefetcher& pf) {
  int i = 0;
  for (; i + 4 <= nv; i += 4) value_block<HB, 4, T>(o, d, i, p, vt, n, pf);
  for (; i + 2 <= nv; i += 2) value_block<HB, 2, T>(o, d, i, p, vt, n, pf);
  if constexpr (std::is_same<T, float>::value)
    if (i < nv) value_block<HB, 1, T>(o, d, i, p, vt, n, pf);
}

// One task, AVX-512, head_dim a multiple of 16 (of 32 for bf16 and int8) and at most kMaxDim: rep query
// heads (q, rep x d, in the kernel's order) over keys [k0, k1) of one KV head. Leaves unnormalised outputs
// in o (rep x d, the kernel's order) and max/sum in part. NV = d / 16 when known at compile time, else 0.
template <int NV, typename T>
MOSAIC_AVX512 void task_avx512(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1,
                               float* o, Partial* part) {
  // Tile-major: a tile's 16 key rows come from memory once and stay in L1 while every query head of the
  // group scores them; then its 16 value rows, while every head accumulates them. Heads go in blocks of
  // 4 (the last block 1-3), so each row slice loaded from L1 feeds several heads.
  const int nv = NV ? NV : d / 16;
  // The next tiles' lines are prefetched spread over this tile's inner iterations (Prefetcher).
  const int tile_lines = kTile * d * static_cast<int>(sizeof(T)) / 64;
  const int blocks = (rep + 3) / 4;
  const int steps = blocks * (kTile / 4) * (nv / 2) + blocks * ((nv + 3) / 4) * kTile;  // a full tile's
  const int per_step = (2 * tile_lines + steps - 1) / steps;
  const int64_t ahead = static_cast<int64_t>(kAhead) * kTile * d;  // elements
  alignas(64) float probs[kMaxRep][kTile];
  alignas(64) __m512 a[4 * kTile];  // one head block's lane-partial scores
  SoftmaxState sm;
  sm.start(o, rep, d);
  for (int j0 = k0; j0 < k1; j0 += kTile) {
    const int n = std::min(kTile, k1 - j0);
    const __mmask16 live = tile_mask(n);
    const T* kt = k + static_cast<int64_t>(j0) * d;
    const T* vt = v + static_cast<int64_t>(j0) * d;
    Prefetcher pf{reinterpret_cast<const char*>(kt + ahead), reinterpret_cast<const char*>(vt + ahead), tile_lines,
                  per_step};
    for (int r0 = 0; r0 < rep; r0 += 4) {  // scores, one head block at a time
      const int hb = std::min(4, rep - r0);
      const float* qb = q + static_cast<int64_t>(r0) * d;  // already times scale
      for (int j = 0; j < kTile; j += 4) {
        if (j >= n) {
          for (int h = 0; h < hb; ++h)
            for (int jj = 0; jj < 4; ++jj) a[h * kTile + j + jj] = _mm512_setzero_ps();
          continue;
        }
        // rows past the tile's end repeat its last row: read in bounds, masked out of the softmax below
        const T* krow[4];
        for (int jj = 0; jj < 4; ++jj) krow[jj] = kt + static_cast<int64_t>(std::min(j + jj, n - 1)) * d;
        if (hb == 4) score_block<4, T>(qb, d, nv, krow, a + j, pf);
        else if (hb == 3) score_block<3, T>(qb, d, nv, krow, a + j, pf);
        else if (hb == 2) score_block<2, T>(qb, d, nv, krow, a + j, pf);
        else score_block<1, T>(qb, d, nv, krow, a + j, pf);
      }
      // An int8 key's dot product times its row's scale; a float key's scale is 1.
      const __m512 kscale = rs.k ? _mm512_maskz_loadu_ps(live, rs.k + j0) : _mm512_set1_ps(1.f);
      const __m512 vscale = rs.v ? _mm512_maskz_loadu_ps(live, rs.v + j0) : _mm512_set1_ps(1.f);
      __m512 sc[4];
      for (int h = 0; h < hb; ++h)
        sc[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live,
                                   _mm512_mul_ps(sum16x16(a + h * kTile), kscale));
      softmax_tile(sc, hb, sm.ref + r0, sm.sums + r0, o + static_cast<int64_t>(r0) * d, d, vscale, probs + r0);
    }
    for (int r0 = 0; r0 < rep; r0 += 4) {  // values, one head block at a time
      const int hb = std::min(4, rep - r0);
      float* ob = o + static_cast<int64_t>(r0) * d;
      if (hb == 4) value_rows<4, T>(ob, d, nv, probs + r0, vt, n, pf);
      else if (hb == 3) value_rows<3, T>(ob, d, nv, probs + r0, vt, n, pf);
      else if (hb == 2) value_rows<2, T>(ob, d, nv, probs + r0, vt, n, pf);
      else value_rows<1, T>(ob, d, nv, probs + r0, vt, n, pf);
    }
  }
  sm.finish(part, rep);
}

// AVX2: head_dim a multiple of 8. Keys outer and the group's query heads inner, so each key or value row
// is read from memory once and from L1 by the other heads; scores, then the softmax, then the values.
#include "simd_avx2.h"

MOSAIC_AVX2 inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
MOSAIC_AVX2 inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
MOSAIC_AVX2 inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename T>
MOSAIC_AVX2 void task_avx2(const float* q, int rep, int d, const T* k, const T* v, RowScales rs, int k0, int k1,
                           float* o, Partial* part) {
  thread_local std::vector<float> scores;  // [rep][k1 - k0]
  const int n = k1 - k0;
  scores.resize(static_cast<size_t>(rep) * n);
  for (int j = 0; j < n; ++j) {
    const T* kr = k + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(kr + 4 * d), _MM_HINT_T0);
    for (int r = 0; r < rep; ++r) {
      const float* qr = q + static_cast<int64_t>(r) * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int i = 0;
      for (; i + 16 <= d; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), widen8(kr + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i + 8), widen8(kr + i + 8), a1);
      }
      if (i < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + i), widen8(kr + i), a0);
      const __m256 a = _mm256_add_ps(a0, a1);
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      const float dot = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      scores[static_cast<size_t>(r) * n + j] = rs.k ? dot * rs.k[k0 + j] : dot;
    }
  }
  for (int r = 0; r < rep; ++r) {
    float* sr = scores.data() + static_cast<size_t>(r) * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) m = std::max(m, sr[j]);
    float l = 0.f;
    for (int j = 0; j < n; ++j) {
      const float p = std::exp(sr[j] - m);
      l += p;
      sr[j] = rs.v ? p * rs.v[k0 + j] : p;
    }
    part[r] = {m, l};
    std::fill(o + static_cast<int64_t>(r) * d, o + static_cast<int64_t>(r + 1) * d, 0.f);
  }
  for (int j = 0; j < n; ++j) {
    const T* vr = v + static_cast<int64_t>(k0 + j) * d;
    if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(vr + 4 * d), _MM_HINT_T0);
    for (int r = 0; r < rep; ++r) {
      const __m256 p = _mm256_set1_ps(scores[static_cast<size_t>(r) * n + j]);
      float* orow = o + static_cast<int64_t>(r) * d;
      for (int i = 0; i < d; i += 8)
        _mm256_storeu_ps(orow + i, _mm256_fmadd_ps(p, widen8(vr + i), _mm256_loadu_ps(orow + i)));
    }
  }
}

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

template <typename T>
void attend(const float* q, int heads, int head_dim, const T* k, const T* v, int64_t k_head_stride,
            int64_t v_head_stride, const float* k_scale, const float* v_scale, int64_t scale_head_stride,
            int kv_heads, int length, float scale, float* out, int threads, Isa isa, const float* sinks) {
  const int rep = heads / kv_heads, d = head_dim;
  const int chunks = std::max(1, (length + kChunk - 1) / kChunk);
  const int tasks = kv_heads * chunks;
  constexpr bool bf16 = std::is_same<T, uint16_t>::value, int8 = std::is_same<T, int8_t>::value;
  // bf16 and int8 rows are loaded 32 values at a time (load_pair, attention_i8.cpp)
  const bool wide = vector_isa(isa) == Isa::Avx512 && d % (int8 || bf16 ? 32 : 16) == 0 && d <= kMaxDim &&
                    rep <= kMaxRep;
  const bool avx2 = !wide && vector_isa(isa) != Isa::Scalar && d % 8 == 0;  // task_avx2
  const bool integer = int8 && wide && isa == Isa::Avx512Vnni;  // task_i8_vnni
  // Where the AVX-512 loops keep element i of a query or output row: bf16 rows go as evens then odds
  // inside each block of 32 (load_pair); the integer int8 task's outputs in i8_order; otherwise in place.
  const bool split = bf16 && wide;
  auto at = [split](int i) { return split ? (i & ~31) + (i & 1) * 16 + (i & 31) / 2 : i; };
  auto out_at = [&at, integer](int i) { return integer ? (i & ~31) + i8_order(i & 31) : at(i); };
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
      for (int i = 0; i < d; ++i) q_buf[static_cast<size_t>(h) * d + at(i)] = q[static_cast<size_t>(h) * d + i] * scale;
  }
  const int16_t* q16 = q16_buf.data();
  const float* qf = q_buf.data();
  o_buf.resize(static_cast<size_t>(tasks) * rep * d);
  part_buf.resize(static_cast<size_t>(tasks) * rep);
  float* o_all = o_buf.data();
  Partial* part_all = part_buf.data();
#pragma omp parallel for num_threads(std::min(threads, tasks)) schedule(static)
  for (int t = 0; t < tasks; ++t) {
    const int g = t / chunks, c = t % chunks;
    const int k0 = c * kChunk, k1 = std::min(length, k0 + kChunk);
    const float* qg = qf + static_cast<int64_t>(g) * rep * d;
    float* o = o_all + static_cast<int64_t>(t) * rep * d;
    Partial* part = part_all + static_cast<int64_t>(t) * rep;
    const T* kg = k + g * k_head_stride;
    const T* vg = v + g * v_head_stride;
    const RowScales rs{k_scale ? k_scale + g * scale_head_stride : nullptr,
                       v_scale ? v_scale + g * scale_head_stride : nullptr};
    if constexpr (int8) {
      if (integer) {
        task_i8_vnni(q16 + static_cast<int64_t>(g) * rep * d, qf + g * rep, rep, d, kg, vg, rs, k0, k1, o, part);
        continue;
      }
    }
    if (avx2) task_avx2(qg, rep, d, kg, vg, rs, k0, k1, o, part);
    else if (!wide) task_scalar(qg, rep, d, kg, vg, rs, k0, k1, o, part);
    else if (d == 64) task_avx512<4, T>(qg, rep, d, kg, vg, rs, k0, k1, o, part);
    else if (d == 128) task_avx512<8, T>(qg, rep, d, kg, vg, rs, k0, k1, o, part);
    else if (d == 256) task_avx512<16, T>(qg, rep, d, kg, vg, rs, k0, k1, o, part);
    else task_avx512<0, T>(qg, rep, d, kg, vg, rs, k0, k1, o, part);
  }
  // Merge each query head's chunks in ascending order, in the kernel's element order (a loop that
  // vectorizes), then put the elements back in place. A sink is one more logit in the denominator.
  const int rows = kv_heads * rep;
#pragma omp parallel for num_threads(std::min(threads, rows)) schedule(static)
  for (int row = 0; row < rows; ++row) {
    const int g = row / rep, r = row % rep;
    float m = sinks ? sinks[row] : -std::numeric_limits<float>::infinity();
    for (int c = 0; c < chunks; ++c) m = std::max(m, part_all[(g * chunks + c) * rep + r].ref);
    std::vector<float> acc(d, 0.f);
    float l = sinks ? std::exp(sinks[row] - m) : 0.f;
    for (int c = 0; c < chunks; ++c) {
      const int t = g * chunks + c;
      const float w = std::exp(part_all[t * rep + r].ref - m);
      l += part_all[t * rep + r].sum * w;
      const float* o = o_all + (static_cast<int64_t>(t) * rep + r) * d;
      for (int i = 0; i < d; ++i) acc[i] += o[i] * w;
    }
    const float inv = 1.f / l;
    float* dst = out + static_cast<int64_t>(row) * d;
    for (int i = 0; i < d; ++i) dst[i] = acc[out_at(i)] * inv;
  }
}

}  // namespace

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
