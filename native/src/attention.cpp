// Decode attention: one new token's query heads against every cached key and value, read once.
//
// The query heads that share a KV head are served together, so each key and value row is read from
// memory once for all of them (GQA). Keys are cut into fixed chunks of kChunk; each (KV head, chunk) is a
// task with its own running max, sum and output (online softmax, flash-decoding), and the chunks are
// merged in ascending order: the result depends on the length only, never on the thread count.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "mosaic/kernels.h"
#include "simd_avx512.h"

namespace mosaic {
namespace {

constexpr int kChunk = 512;  // keys per task: 2 x 512 KB of f32 K and V at head_dim 256
constexpr int kTile = 16;    // keys whose scores are exponentiated together (one zmm)
constexpr int kWidenAhead = 4 * 16 * 256;  // bf16 elements the widen pass prefetches ahead: 32 KB
constexpr int kAhead = 1;    // float32 tiles' worth of bytes prefetched ahead (16 KB at head_dim 256)

struct Partial {  // one task's state for one query head
  float max, sum;
};

// exp(x) for x <= 0 (scores minus their max), to about 2 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6
// polynomial for e^r, then scaled by 2^n. Below -87 the result is 0 (a masked key's score is -inf).
MOSAIC_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two for accuracy
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// S[j] = the sum of acc[j]'s 16 lanes, for 16 accumulators at once: pairwise adds through unpacks and
// 128-bit block shuffles, 45 operations instead of 16 separate reductions (128).
MOSAIC_AVX512 inline __m512 sum16x16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit block: [a2j partial, a2j+1 partial] x 2
    b[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per block: [a4j, a4j+1, a4j+2, a4j+3] partials
    const __m512d x = _mm512_castps_pd(b[2 * j]), y = _mm512_castps_pd(b[2 * j + 1]);
    c[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// A tile of cached rows as floats: float32 in place; bf16 widened exactly (its bits are a float's top
// half) into buf. count is a multiple of 16 (whole rows of a head_dim that is).
MOSAIC_AVX512 inline const float* widen_tile(const float* p, int, float*) { return p; }
MOSAIC_AVX512 inline const float* widen_tile(const uint16_t* p, int count, float* buf) {
  for (int i = 0; i < count; i += 16) {
    // The stream ahead into L2 (a widened tile fills L1 itself): the widen pass reads memory, not cache.
    if (i % 32 == 0) _mm_prefetch(reinterpret_cast<const char*>(p + i + kWidenAhead), _MM_HINT_T1);
    _mm512_store_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))), 16)));
  }
  return buf;
}
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Lines [first, first + count) of the rows at base (clipped to `lines`), towards L1. Prefetching past the
// end of the cache is harmless: prefetches never fault.
template <typename T>
inline void prefetch_lines(const T* base, int first, int count, int lines) {
  const char* p = reinterpret_cast<const char*>(base);
  for (int i = first; i < std::min(first + count, lines); ++i) _mm_prefetch(p + 64 * static_cast<int64_t>(i), _MM_HINT_T0);
}

// One task, AVX-512, head_dim a multiple of 16 and at most kMaxDim: rep query heads (q, rep x d) over
// keys [k0, k1) of one KV head. Leaves unnormalised outputs in o (rep x d) and max/sum in part.
// NV = d / 16 when known at compile time (the query and output rows then stay in registers), else 0.
constexpr int kMaxDim = 512;

template <int NV, typename T>
MOSAIC_AVX512 void task_avx512(const float* q, int rep, int d, const T* k, const T* v, int k0, int k1,
                               float* o, Partial* part) {
  // Tile-major: a tile's 16 key rows come from memory once and stay in L1 while every query head of the
  // group scores them; then its 16 value rows, while every head accumulates them. Each phase touches one
  // 16-row tile (16 KB at head_dim 256) beside the queries or outputs, well inside L1.
  const int nv = NV ? NV : d / 16;
  // The next tile's rows are prefetched while this one computes, spread evenly over the (head, key)
  // iterations of each phase, so DRAM streams behind the arithmetic instead of stalling the first head.
  const int tile_lines = kTile * d * static_cast<int>(sizeof(T)) / 64;  // 64-byte lines in one tile of K (or V)
  const int per_step = (tile_lines + rep * kTile - 1) / (rep * kTile);
  // How far ahead, in elements: kAhead float32 tiles' worth of bytes, so two bf16 tiles.
  const int64_t ahead = static_cast<int64_t>(kAhead) * kTile * d * 4 / static_cast<int64_t>(sizeof(T));
  constexpr int kMaxRep = 64;
  // Widened bf16 tiles (unused for float32), on the stack: one key tile and one value tile.
  alignas(64) float tile_k[std::is_same<T, float>::value ? 16 : kTile * kMaxDim];
  alignas(64) float tile_v[std::is_same<T, float>::value ? 16 : kTile * kMaxDim];
  alignas(64) float probs[kMaxRep][kTile];
  float correction[kMaxRep];
  for (int r = 0; r < rep; ++r) {
    std::fill(o + static_cast<int64_t>(r) * d, o + static_cast<int64_t>(r + 1) * d, 0.f);
    part[r] = {-std::numeric_limits<float>::infinity(), 0.f};
  }
  for (int j0 = k0; j0 < k1; j0 += kTile) {
    const int n = std::min(kTile, k1 - j0);
    const __mmask16 live = n == kTile ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const T* kt = k + static_cast<int64_t>(j0) * d;
    const T* vt = v + static_cast<int64_t>(j0) * d;
    // A bf16 tile is widened once into L1 (every head then reads floats); a float32 tile is used in place.
    const float* kf = widen_tile(kt, n * d, tile_k);
    const float* vf = widen_tile(vt, n * d, tile_v);
    for (int r = 0; r < rep; ++r) {  // scores, row by row (sequential reads), q in registers
      const float* qr = q + static_cast<int64_t>(r) * d;  // already times scale
      __m512 qv[NV ? NV : kMaxDim / 16], a[kTile];
      for (int i = 0; i < nv; ++i) qv[i] = _mm512_loadu_ps(qr + 16 * i);
      for (int j = 0; j < kTile; ++j) {
        if (j >= n) {
          a[j] = _mm512_setzero_ps();
          continue;
        }
        const float* kr = kf + static_cast<int64_t>(j) * d;
        if (std::is_same<T, float>::value) prefetch_lines(kt + ahead, (r * kTile + j) * per_step, per_step, tile_lines);
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int i = 0;
        for (; i + 2 <= nv; i += 2) {
          a0 = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), a0);
          a1 = _mm512_fmadd_ps(qv[i + 1], _mm512_loadu_ps(kr + 16 * i + 16), a1);
        }
        if (i < nv) a0 = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kr + 16 * i), a0);
        a[j] = _mm512_add_ps(a0, a1);
      }
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), live, sum16x16(a));
      const float m_new = std::max(part[r].max, _mm512_reduce_max_ps(s));
      // 0 on the first tile (max = -inf); the vector exp, so no call spills the registers
      correction[r] = _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(part[r].max - m_new)));
      const __m512 p = exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(m_new)));
      part[r] = {m_new, part[r].sum * correction[r] + _mm512_reduce_add_ps(p)};
      _mm512_store_ps(probs[r], p);
    }
    for (int r = 0; r < rep; ++r) {  // values: the head's output row in registers over the tile
      float* orow = o + static_cast<int64_t>(r) * d;
      const __m512 c = _mm512_set1_ps(correction[r]);
      __m512 acc[NV ? NV : kMaxDim / 16];
      for (int i = 0; i < nv; ++i) acc[i] = _mm512_mul_ps(_mm512_loadu_ps(orow + 16 * i), c);
      for (int j = 0; j < n; ++j) {
        const __m512 pj = _mm512_set1_ps(probs[r][j]);
        const float* vr = vf + static_cast<int64_t>(j) * d;
        if (std::is_same<T, float>::value) prefetch_lines(vt + ahead, (r * kTile + j) * per_step, per_step, tile_lines);
        for (int i = 0; i < nv; ++i) acc[i] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * i), acc[i]);
      }
      for (int i = 0; i < nv; ++i) _mm512_storeu_ps(orow + 16 * i, acc[i]);
    }
  }
}

template <typename T>
void task_scalar(const float* q, int rep, int d, const T* k, const T* v, int k0, int k1, float* o, Partial* part) {
  std::vector<float> s(k1 - k0);
  for (int r = 0; r < rep; ++r) {
    const float* qr = q + static_cast<int64_t>(r) * d;
    float m = -std::numeric_limits<float>::infinity();
    for (int j = k0; j < k1; ++j) {
      float dot = 0.f;
      for (int i = 0; i < d; ++i) dot += qr[i] * widen(k[static_cast<int64_t>(j) * d + i]);
      s[j - k0] = dot;
      m = std::max(m, dot);
    }
    float l = 0.f;
    float* orow = o + static_cast<int64_t>(r) * d;
    std::fill(orow, orow + d, 0.f);
    for (int j = k0; j < k1; ++j) {
      const float p = std::exp(s[j - k0] - m);
      l += p;
      for (int i = 0; i < d; ++i) orow[i] += p * widen(v[static_cast<int64_t>(j) * d + i]);
    }
    part[r] = {m, l};
  }
}

template <typename T>
void attend(const float* q, int heads, int head_dim, const T* k, const T* v, int64_t k_head_stride,
            int64_t v_head_stride, int kv_heads, int length, float scale, float* out, int threads, Isa isa) {
  const int rep = heads / kv_heads, d = head_dim;
  const int chunks = std::max(1, (length + kChunk - 1) / kChunk);
  const int tasks = kv_heads * chunks;
  const bool wide = (isa == Isa::Avx512 || isa == Isa::Avx512Vnni) && d % 16 == 0 && d <= kMaxDim && rep <= 64;
  thread_local std::vector<float> o_buf, q_buf;
  thread_local std::vector<Partial> part_buf;
  q_buf.resize(static_cast<size_t>(heads) * d);  // the queries times scale: what every task dots with
  for (size_t i = 0; i < q_buf.size(); ++i) q_buf[i] = q[i] * scale;
  q = q_buf.data();
  o_buf.resize(static_cast<size_t>(tasks) * rep * d);
  part_buf.resize(static_cast<size_t>(tasks) * rep);
  float* o_all = o_buf.data();
  Partial* part_all = part_buf.data();
#pragma omp parallel for num_threads(std::min(threads, tasks)) schedule(static)
  for (int t = 0; t < tasks; ++t) {
    const int g = t / chunks, c = t % chunks;
    const int k0 = c * kChunk, k1 = std::min(length, k0 + kChunk);
    const float* qg = q + static_cast<int64_t>(g) * rep * d;
    float* o = o_all + static_cast<int64_t>(t) * rep * d;
    Partial* part = part_all + static_cast<int64_t>(t) * rep;
    const T* kg = k + g * k_head_stride;
    const T* vg = v + g * v_head_stride;
    if (!wide) task_scalar(qg, rep, d, kg, vg, k0, k1, o, part);
    else if (d == 64) task_avx512<4, T>(qg, rep, d, kg, vg, k0, k1, o, part);
    else if (d == 128) task_avx512<8, T>(qg, rep, d, kg, vg, k0, k1, o, part);
    else if (d == 256) task_avx512<16, T>(qg, rep, d, kg, vg, k0, k1, o, part);
    else task_avx512<0, T>(qg, rep, d, kg, vg, k0, k1, o, part);
  }
  // Merge each query head's chunks in ascending order.
  for (int g = 0; g < kv_heads; ++g) {
    for (int r = 0; r < rep; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < chunks; ++c) m = std::max(m, part_all[(g * chunks + c) * rep + r].max);
      float* dst = out + (static_cast<int64_t>(g) * rep + r) * d;
      std::fill(dst, dst + d, 0.f);
      float l = 0.f;
      for (int c = 0; c < chunks; ++c) {
        const int t = g * chunks + c;
        const float w = std::exp(part_all[t * rep + r].max - m);
        l += part_all[t * rep + r].sum * w;
        const float* o = o_all + (static_cast<int64_t>(t) * rep + r) * d;
        for (int i = 0; i < d; ++i) dst[i] += o[i] * w;
      }
      const float inv = 1.f / l;
      for (int i = 0; i < d; ++i) dst[i] *= inv;
    }
  }
}

}  // namespace

void decode_attention(const float* q, int heads, int head_dim, const float* k, const float* v, int64_t k_head_stride,
                      int64_t v_head_stride, int kv_heads, int length, float scale, float* out, int threads, Isa isa) {
  attend(q, heads, head_dim, k, v, k_head_stride, v_head_stride, kv_heads, length, scale, out, threads, isa);
}

void decode_attention_bf16(const float* q, int heads, int head_dim, const uint16_t* k, const uint16_t* v,
                           int64_t k_head_stride, int64_t v_head_stride, int kv_heads, int length, float scale,
                           float* out, int threads, Isa isa) {
  attend(q, heads, head_dim, k, v, k_head_stride, v_head_stride, kv_heads, length, scale, out, threads, isa);
}

}  // namespace mosaic
