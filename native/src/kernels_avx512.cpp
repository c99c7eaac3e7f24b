// AVX-512 kernels: nibbles/E4M3 widened to float in registers, FMA against up to 4 tokens at once,
// software prefetch a few KB ahead in the row (FACTS.md §3: it took Q4 blocks from 0.34 to 0.83 of the
// memory roofline in a prototype here).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mosaic/kernels.h"
#include "prefill_blocks.h"
#include "simd_avx512.h"


namespace mosaic {
namespace {

constexpr int kTokTile = 4;
constexpr int kPrefetch = 4096;  // bytes ahead in the row stream
// Bytes ahead in a Q4 scales plane (8 rows of 2048 columns). The scales are a second stream, an eighth of
// the codes' bytes; left to the hardware prefetcher, their misses stalled the Q4 loops at half the streaming
// bandwidth (in-process A/B on the Zen 5 here, 2 threads: 33 GB/s without, 52 with, the stream at 61).
constexpr int kScalePrefetch = 1024;

MOSAIC_AVX512 inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

constexpr int kGroup = 16;  // blocks whose weight scales are converted with one vcvtph2ps

// Block b's 32 codes as floats (elements 0..15 in lo, 16..31 in hi), prefetching the row ahead a line
// every 4 blocks.
MOSAIC_AVX512 inline void q4_codes(const uint8_t* row, int b, __m512& lo, __m512& hi) {
  if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + b * 16 + kPrefetch), _MM_HINT_T0);
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(0x0F)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}

// One token (a decode step): the same sums as q4_avx512's loop, but the whole blocks take unmasked loads,
// two accumulators alternate so the FMA latency is not paid on every block, and nothing lives on the
// stack (the token-tiled loop keeps its accumulators there, which cost more than the arithmetic).
MOSAIC_AVX512 static void q4_avx512_one(const MatvecArgs& a, int blocks, int groups, const float* off8) {
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  const int whole = a.cols / kQ4;  // blocks with all 32 columns
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint16_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), off = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      const int b0 = g * kGroup, nb = std::min(kGroup, blocks - b0);
      _mm_prefetch(reinterpret_cast<const char*>(rs + b0) + kScalePrefetch, _MM_HINT_T0);
      const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << nb) - 1), rs + b0));
      off = _mm512_fmadd_ps(d, _mm512_loadu_ps(off8 + b0), off);
      for (int k = 0; k < nb; ++k) {
        const int b = b0 + k;
        __m512 lo, hi;
        q4_codes(row, b, lo, hi);
        const __m512 db = _mm512_permutexvar_ps(_mm512_set1_epi32(k), d);
        const float* x = a.x + b * kQ4;
        __m512 x0, x1;
        if (b < whole) {
          x0 = _mm512_loadu_ps(x);
          x1 = _mm512_loadu_ps(x + 16);
        } else {
          const int len = a.cols - b * kQ4;
          x0 = _mm512_maskz_loadu_ps(len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1), x);
          x1 = _mm512_maskz_loadu_ps(len <= 16 ? 0 : static_cast<__mmask16>((1u << (len - 16)) - 1), x + 16);
        }
        const __m512 dot = _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0));
        if (k & 1) odd = _mm512_fmadd_ps(dot, db, odd);
        else even = _mm512_fmadd_ps(dot, db, even);
      }
    }
    a.y[r] = reduce(_mm512_add_ps(even, odd)) - reduce(off);
  }
}

// Q4 in float: sum_b d_b * (codes . x_b) - sum_b d_b * 8 * sum(x_b), so the loop widens each code once
// (one vpmovzxbd for 32 nibbles) and never subtracts the offset per weight.
MOSAIC_AVX512 void q4_avx512(const MatvecArgs& a) {
  const int blocks = (a.cols + kQ4 - 1) / kQ4, groups = (blocks + kGroup - 1) / kGroup;
  const size_t per_t = static_cast<size_t>(groups) * kGroup;
  thread_local std::vector<float> off8;  // [n][groups * 16]: 8 * sum of x over each block
  off8.assign(per_t * a.n, 0.f);         // capacity kept across calls: no allocation once warm
  for (int t = 0; t < a.n; ++t)
    for (int c = 0; c < a.cols; ++c) off8[per_t * t + c / kQ4] += 8.f * a.x[static_cast<uint64_t>(t) * a.ldx + c];
  const auto* scales = static_cast<const uint16_t*>(a.scales);
  if (a.n == 1) {  // a decode step: q4_avx512_one
    q4_avx512_one(a, blocks, groups, off8.data());
    return;
  }
  __m512i lane[kGroup];
  for (int i = 0; i < kGroup; ++i) lane[i] = _mm512_set1_epi32(i);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint16_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m512 acc[kTokTile], off[kTokTile];
      for (int t = 0; t < kTokTile; ++t) acc[t] = off[t] = _mm512_setzero_ps();
      for (int g = 0; g < groups; ++g) {
        const int b0 = g * kGroup, nb = std::min(kGroup, blocks - b0);
        const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << nb) - 1), rs + b0));
        for (int t = 0; t < nt; ++t) off[t] = _mm512_fmadd_ps(d, _mm512_loadu_ps(&off8[per_t * (t0 + t) + b0]), off[t]);
        for (int k = 0; k < nb; ++k) {
          const int b = b0 + k;
          __m512 lo, hi;
          q4_codes(row, b, lo, hi);
          const __m512 db = _mm512_permutexvar_ps(lane[k], d);
          const int c = b * kQ4, len = std::min(kQ4, a.cols - c);
          const __mmask16 mlo = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
          const __mmask16 mhi = len >= 32 ? 0xFFFF : (len <= 16 ? 0 : static_cast<__mmask16>((1u << (len - 16)) - 1));
          for (int t = 0; t < nt; ++t) {
            const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c;
            const __m512 dot = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(mhi, x + 16),
                                               _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mlo, x)));
            acc[t] = _mm512_fmadd_ps(dot, db, acc[t]);
          }
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = reduce(acc[t]) - reduce(off[t]);
    }
  }
}

// One token (a decode step): fp8_avx512's sums with the accumulators in registers, two alternating
// within each 128-column block, and unmasked loads for whole 16-column slices.
MOSAIC_AVX512 static void fp8_avx512_one(const MatvecArgs& a) {
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    const uint64_t srow = static_cast<uint64_t>(r / kFp8) * scale_cols;
    __m512 total = _mm512_setzero_ps();
    for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
      const int end = std::min(c0 + kFp8, a.cols);
      __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
      for (int c = c0; c < end; c += 16) {
        if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + c + kPrefetch), _MM_HINT_T0);
        const int len = std::min(16, end - c);
        const __mmask16 m = len == 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
        const __m512 w = e4m3x16(row + c, m);
        const __m512 x = len == 16 ? _mm512_loadu_ps(a.x + c) : _mm512_maskz_loadu_ps(m, a.x + c);
        if ((c - c0) & 16) odd = _mm512_fmadd_ps(w, x, odd);
        else even = _mm512_fmadd_ps(w, x, even);
      }
      const __m512 s = _mm512_set1_ps(scale_at(a.scales, a.scale_dtype, srow + c0 / kFp8) * 256.f);
      total = _mm512_fmadd_ps(_mm512_add_ps(even, odd), s, total);
    }
    a.y[r] = reduce(total);
  }
}

MOSAIC_AVX512 void fp8_avx512(const MatvecArgs& a) {
  if (a.n == 1) {  // a decode step
    fp8_avx512_one(a);
    return;
  }
  const int scale_cols = (a.cols + kFp8 - 1) / kFp8;
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * a.cols;
    const uint64_t srow = static_cast<uint64_t>(r / kFp8) * scale_cols;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m512 total[kTokTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int c0 = 0; c0 < a.cols; c0 += kFp8) {
        const int end = std::min(c0 + kFp8, a.cols);
        __m512 acc[kTokTile] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int c = c0; c < end; c += 16) {
          if ((c & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + c + kPrefetch), _MM_HINT_T0);
          const int len = std::min(16, end - c);
          const __mmask16 m = len == 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
          const __m512 w = e4m3x16(row + c, m);
          for (int t = 0; t < nt; ++t)
            acc[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c), acc[t]);
        }
        const __m512 s = _mm512_set1_ps(scale_at(a.scales, a.scale_dtype, srow + c0 / kFp8) * 256.f);
        for (int t = 0; t < nt; ++t) total[t] = _mm512_fmadd_ps(acc[t], s, total[t]);
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = reduce(total[t]);
    }
  }
}

// --- Q4 with int8 activations (AVX-512 VNNI) ----------------------------------------------------
// x is quantised once per call to int8 per 32-block (scale sx = amax/127). Two vpdpbusd multiply the 128
// nibble codes of four blocks (u8, as stored: 0..15; low nibbles, then high) by their activations (s8)
// into 16 int32 lanes of 8 products each; each lane is then scaled by d (weight block) * sx (activation
// block). The codes' offset of 8 is taken out once per row: sum_b d_b * 8 * sx_b * sum(q in b).
// Activations lose about 0.4 % (int8); weights are exact.
#define MOSAIC_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

struct QuantisedX {
  std::vector<int8_t> q;     // [n][quads * 128]: per quad of 4 blocks, the elements each block's low nibbles
                             // hold (Q4: 0..15; MXFP4: the even ones), then its high nibbles' (16..31; odd)
  std::vector<float> sx;     // [n][groups * 16]: activation scale per block, zero past the last block
  std::vector<float> off;    // [n][groups * 16]: zero * sx * sum(q) per block, zero the codes' offset
  std::vector<int32_t> zsum; // [n][groups * 16]: zero * sum(q) per block, the offset in integers
};

// The weights' side of the int8 kernels: how a block's codes become unsigned bytes w + zero, and where the
// low and high nibbles' elements sit.
struct Q4Codes {  // codes 0..15 are w + 8; low nibbles hold elements 0..15, high ones 16..31
  static constexpr float kZero = 8.f;
  static constexpr bool kPairs = false;
};
struct Mxfp4Codes {  // E2M1 codes through a table to 2 * e2m1 + 12 (0..24); nibbles hold elements 2j, 2j + 1
  static constexpr float kZero = 12.f;
  static constexpr bool kPairs = true;
};

// In vector ops (it runs once per matvec call: 24 times a MoE layer per token): the same codes as
// rounding each x * inv to nearest even, one block of 32 at a time.
template <typename Codes>
MOSAIC_VNNI static void quantise_x(const MatvecArgs& a, int quads, int groups, QuantisedX& out) {
  const size_t per_q = static_cast<size_t>(quads) * 128, per_b = static_cast<size_t>(groups) * kGroup;
  out.q.assign(per_q * a.n, 0);  // capacity is kept across calls: no allocation once warm
  out.sx.assign(per_b * a.n, 0.f);
  out.off.assign(per_b * a.n, 0.f);
  out.zsum.assign(per_b * a.n, 0);
  for (int t = 0; t < a.n; ++t) {
    const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
    int8_t* q = out.q.data() + per_q * t;
    for (int b = 0; b * kQ4 < a.cols; ++b) {
      const int c0 = b * kQ4;
      __m512i v0, v1;
      const float sx = quantise_block<Codes::kPairs>(x + c0, std::min(kQ4, a.cols - c0), v0, v1) / 127.f;
      int8_t* quad = q + (b / 4) * 128 + (b % 4) * 16;  // the low nibbles' elements, then the high ones'
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quad), _mm512_cvtsepi32_epi8(v0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(quad + 64), _mm512_cvtsepi32_epi8(v1));
      const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
      out.sx[per_b * t + b] = sx;
      out.off[per_b * t + b] = Codes::kZero * sx * static_cast<float>(sum);
      out.zsum[per_b * t + b] = static_cast<int>(Codes::kZero) * sum;
    }
  }
}

// R consecutive rows against one token's quantised x: y[i] = row i . x. Per 64 bytes of weights (4
// blocks): one load, the two nibble masks, two vpdpbusd into one int32 vector (lane l holds block l / 4),
// then one convert, scale permute and FMA: 8 vector ops. Steps of two blocks took 16 and reached 0.75 of
// the streaming bandwidth on 2 threads, where this reaches it: fewer ops per byte keep more of the row's
// loads in flight. The rows share the activation loads, and the codes' offset goes into each row's
// accumulator (its lanes are summed anyway), so a row ends in one reduction.
constexpr int kVnniPrefetch = 8192;  // 0.8 % faster than 4096 with the scales prefetched (same A/B)
// Rows of more than this many columns prefetch into L2, not L1: their quantised x (a byte a column, plus
// scales) and 8 KB of prefetched codes no longer fit L1 together, and evicting x stalled rows of 16k-18k
// columns (o_proj, a dense down_proj) at 15-19 GB/s where L2 prefetches reach 25-28; short rows (an
// expert's 768 or 2048) run faster with L1 prefetches (benchmarks/RESULTS.md, "Expert kernel").
constexpr int kL2PrefetchCols = 4096;

// A group's 16 weight scales: Q4's f16, or MXFP4's E8M0 as 2^(s - 127) / 2 (its codes are doubled), an
// exponent field moved into place (s = 0, 2^-127, becomes 0: no weight that small changes a sum).
template <typename Codes>
MOSAIC_VNNI inline __m512 group_scales(const void* rs, __mmask16 in_group) {
  if constexpr (std::is_same<Codes, Mxfp4Codes>::value) {
    const __m512i s = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in_group, rs));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(s, 23)), _mm512_set1_ps(0.5f));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in_group, rs));
  }
}

template <int R, int Hint, typename Codes = Q4Codes>
MOSAIC_VNNI inline void q4_vnni_rows(const uint8_t* row0, const void* rs_base, int blocks, int groups, const int8_t* q,
                                     const float* sx, const float* off, const __m512i* lane_block, float* y) {
  constexpr bool mx = std::is_same<Codes, Mxfp4Codes>::value;
  const auto* rs0 = static_cast<const std::conditional_t<mx, uint8_t, uint16_t>*>(rs_base);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const int64_t row_bytes = static_cast<int64_t>(blocks) * kQ4Bytes;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * kGroup, nb = std::min(kGroup, blocks - b0);
    const __mmask16 in_group = static_cast<__mmask16>((1u << nb) - 1);
    const __m512 sxv = _mm512_loadu_ps(sx + b0), offv = _mm512_loadu_ps(off + b0);
    __m512 dsx[R];
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(rs0 + i * blocks + b0) + kScalePrefetch, _MM_HINT_T0);
      const __m512 d = group_scales<Codes>(rs0 + i * blocks + b0, in_group);
      dsx[i] = _mm512_mul_ps(d, sxv);
      acc[i] = _mm512_fnmadd_ps(d, offv, acc[i]);
    }
    for (int k = 0; 4 * k < nb; ++k) {
      const int p = b0 / 4 + k;
      const int in = std::min(4, nb - 4 * k);  // a short last quad is read masked, never past the row
      const __m512i ql = _mm512_loadu_si512(q + p * 128), qh = _mm512_loadu_si512(q + p * 128 + 64);
      for (int i = 0; i < R; ++i) {
        const uint8_t* at = row0 + i * row_bytes + p * 64;
        _mm_prefetch(reinterpret_cast<const char*>(at + kVnniPrefetch), static_cast<_mm_hint>(Hint));
        const __m512i v = in == 4 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8((1ull << (in * 16)) - 1, at);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (mx) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ql), hi, qh);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane_block[k], dsx[i]), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) y[i] = reduce(acc[i]);
}

// One row against NT tokens of a prefill: the row's 64 bytes are loaded and unpacked once for all of them
// (4 of a quad's 8 vector ops), each token then takes its own two vpdpbusd, convert, scale permute and FMA.
// Each token's sums are those of q4_vnni_rows, in the same order: the result is the same bit for bit.
template <int NT, typename Codes>
MOSAIC_VNNI inline void int8_row_tokens(const uint8_t* row, const void* rs_base, int blocks, int groups,
                                        const int8_t* q, size_t q_stride, const float* sx, const float* off,
                                        size_t s_stride, const __m512i* lane_block, float* y, int64_t ldy) {
  constexpr bool mx = std::is_same<Codes, Mxfp4Codes>::value;
  const auto* rs = static_cast<const std::conditional_t<mx, uint8_t, uint16_t>*>(rs_base);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * kGroup, nb = std::min(kGroup, blocks - b0);
    const __mmask16 in_group = static_cast<__mmask16>((1u << nb) - 1);
    _mm_prefetch(reinterpret_cast<const char*>(rs + b0) + kScalePrefetch, _MM_HINT_T0);
    const __m512 d = group_scales<Codes>(rs + b0, in_group);
    __m512 dsx[NT];
    for (int t = 0; t < NT; ++t) {
      dsx[t] = _mm512_mul_ps(d, _mm512_loadu_ps(sx + t * s_stride + b0));
      acc[t] = _mm512_fnmadd_ps(d, _mm512_loadu_ps(off + t * s_stride + b0), acc[t]);
    }
    for (int k = 0; 4 * k < nb; ++k) {
      const int p = b0 / 4 + k;
      const int in = std::min(4, nb - 4 * k);
      const uint8_t* at = row + p * 64;
      _mm_prefetch(reinterpret_cast<const char*>(at + kVnniPrefetch), _MM_HINT_T0);
      const __m512i v = in == 4 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8((1ull << (in * 16)) - 1, at);
      __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      if constexpr (mx) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
      for (int t = 0; t < NT; ++t) {
        const int8_t* qt = q + t * q_stride + p * 128;
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(qt)),
                                                hi, _mm512_loadu_si512(qt + 64));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane_block[k], dsx[t]), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ldy] = reduce(acc[t]);
}

// --- A prefill with rows in lanes ---------------------------------------------------------------------
// The loops above keep a row's blocks in a vector's lanes, so every block of every token needs its own
// convert, scale permute and FMA beside its two vpdpbusd. Here a vector holds 16 rows instead: a row tile's
// codes are transposed once (RowTile) so that dword group k of a block is one vector of the 16 rows' four
// codes, and a token's four activations of that group are a broadcast operand. A block is then eight
// vpdpbusd into one int32 sum a row (started at minus the codes' offset), one convert, one multiply by
// d * sx and one FMA, for 16 rows x 32 columns: 12 instructions where the row loops take 20.
constexpr int kLaneRows = 16;     // rows a vector holds
constexpr int kLaneTokens = 12;   // tokens sharing a row tile's transposed block: 12 accumulators, 12 sums

struct RowTile {
  std::vector<int32_t> codes;  // [blocks][8 groups][16 rows]: four unsigned codes (w + zero) a dword
  std::vector<float> d;        // [blocks][16 rows]: weight scales (MXFP4's halved: its codes are doubled)
  std::vector<float> rows_d;   // [16 rows][blocks]: the scales as converted, before their transpose
};

// Rows [r0, r0 + rows) of the matrix as a RowTile: a block's 16 code bytes of each row gathered four at a
// time, their low nibbles groups 0-3 (the block's low-nibble elements, as quantise_x lays them) and high
// nibbles groups 4-7. Missing rows repeat row r0; their sums are never stored.
template <typename Codes>
MOSAIC_VNNI void row_tile_codes(const MatvecArgs& a, int r0, int rows, int blocks, RowTile& out) {
  constexpr bool mx = std::is_same<Codes, Mxfp4Codes>::value;
  using Scale = std::conditional_t<mx, uint8_t, uint16_t>;
  const auto* scales = static_cast<const Scale*>(a.scales);
  out.codes.resize(static_cast<size_t>(blocks) * 8 * kLaneRows);
  out.d.resize(static_cast<size_t>(blocks) * kLaneRows);
  out.rows_d.resize(static_cast<size_t>(kLaneRows) * blocks);
  const int64_t row_bytes = static_cast<int64_t>(blocks) * kQ4Bytes;
  alignas(64) int32_t lane_row[kLaneRows];
  for (int i = 0; i < kLaneRows; ++i) lane_row[i] = i < rows ? i : 0;
  const __m512i lanes = _mm512_load_si512(lane_row);
  const __m512i row_at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(row_bytes)));
  const __m512i scale_at = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(blocks));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const uint8_t* base = a.codes + static_cast<uint64_t>(r0) * row_bytes;
  for (int i = 0; i < kLaneRows; ++i) {  // each row's scales as floats, sixteen at a time
    const Scale* rs = scales + static_cast<uint64_t>(r0 + lane_row[i]) * blocks;
    float* d = out.rows_d.data() + static_cast<size_t>(i) * blocks;
    for (int b = 0; b < blocks; b += kGroup) {
      const __mmask16 in = static_cast<__mmask16>(blocks - b >= kGroup ? 0xFFFF : (1u << (blocks - b)) - 1);
      _mm512_mask_storeu_ps(d + b, in, group_scales<Codes>(rs + b, in));
    }
  }
  // A block's 16 code bytes of the 16 rows: each half as two quadword gathers of 8 rows, split into its two
  // dwords by a two-source permute each (half the loads of gathering dwords; at 16-32 tokens the 768 x 2048
  // expert matrices ran 1.05-1.1x, an ad-hoc matvec loop alternated with dword gathers).
  const __m256i rows_lo = _mm512_castsi512_si256(row_at), rows_hi = _mm512_extracti64x4_epi64(row_at, 1);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const detail::NextTile next(a.codes, a.scales, row_bytes, blocks * sizeof(Scale), r0 + kLaneRows, kLaneRows, a.rows,
                              blocks);
  for (int b = 0; b < blocks; ++b) {
    for (size_t l = next.lines_before(b), e = next.lines_before(b + 1); l < e; ++l)
      _mm_prefetch(next.line(l), _MM_HINT_T1);
    int32_t* w = out.codes.data() + static_cast<size_t>(b) * 8 * kLaneRows;
    for (int h = 0; h < 2; ++h) {
      const uint8_t* at = base + b * kQ4Bytes + 8 * h;
      const __m512i g0 = _mm512_i32gather_epi64(rows_lo, at, 1), g1 = _mm512_i32gather_epi64(rows_hi, at, 1);
      for (int j = 0; j < 2; ++j) {
        const int m = 2 * h + j;  // the block's dword m
        const __m512i v = _mm512_permutex2var_epi32(g0, j ? odd : even, g1);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
        if constexpr (mx) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
        _mm512_storeu_si512(w + m * kLaneRows, lo);
        _mm512_storeu_si512(w + (4 + m) * kLaneRows, hi);
      }
    }
    _mm512_storeu_ps(out.d.data() + static_cast<size_t>(b) * kLaneRows,
                    _mm512_i32gather_ps(scale_at, out.rows_d.data() + b, 4));
  }
}

// The activations as the rows-in-lanes loop reads them: tokens in groups of kLaneTokens and, within a group,
// each block's activations of every token side by side, so that a token's sit at a fixed offset from its
// block's (one address a block instead of one a token, which left too few registers for the sums).
struct LaneX {
  std::vector<int8_t> q;          // [token groups][quads][kLaneTokens][128], as QuantisedX::q lays a quad out
  std::vector<float> sx;          // [token groups][blocks][kLaneTokens]
  std::vector<int32_t> neg_zsum;  // [token groups][blocks][kLaneTokens]: minus QuantisedX::zsum
  size_t q_group = 0, s_group = 0;  // a token group's share of q, and of sx and neg_zsum
};

MOSAIC_VNNI void lane_x(const QuantisedX& qx, int n, int quads, int blocks, size_t s_stride, LaneX& out) {
  const int groups = (n + kLaneTokens - 1) / kLaneTokens;
  const size_t q_group = out.q_group = static_cast<size_t>(quads) * kLaneTokens * 128;
  const size_t s_group = out.s_group = static_cast<size_t>(blocks) * kLaneTokens;
  out.q.assign(q_group * groups, 0);  // capacity is kept across calls; padding tokens' sums are never stored
  out.sx.assign(s_group * groups, 0.f);
  out.neg_zsum.assign(s_group * groups, 0);
  for (int t = 0; t < n; ++t) {
    const int g = t / kLaneTokens, i = t % kLaneTokens;
    const int8_t* src = qx.q.data() + static_cast<size_t>(t) * quads * 128;
    int8_t* dst = out.q.data() + g * q_group + static_cast<size_t>(i) * 128;
    for (int quad = 0; quad < quads; ++quad)
      std::memcpy(dst + static_cast<size_t>(quad) * kLaneTokens * 128, src + static_cast<size_t>(quad) * 128, 128);
    for (int b = 0; b < blocks; ++b) {
      out.sx[g * s_group + static_cast<size_t>(b) * kLaneTokens + i] = qx.sx[t * s_stride + b];
      out.neg_zsum[g * s_group + static_cast<size_t>(b) * kLaneTokens + i] = -qx.zsum[t * s_stride + b];
    }
  }
}

// A row tile's 16 rows against the NT tokens of one LaneX group starting at token t0: y[t][r0 + lane] for the
// first `rows` lanes. A block's eight vpdpbusd of one token depend on each other, so the group's tokens
// advance side by side, NT sums in flight: one token at a time waited on vpdpbusd's latency.
template <int NT>
MOSAIC_VNNI void row_tile_tokens(const RowTile& tile, int blocks, const LaneX& lx, int t0, int r0, int rows, float* y,
                                 int64_t ldy) {
  const size_t g = static_cast<size_t>(t0 / kLaneTokens);
  const int8_t* q = lx.q.data() + g * lx.q_group;
  const float* sx = lx.sx.data() + g * lx.s_group;
  const int32_t* neg_zsum = lx.neg_zsum.data() + g * lx.s_group;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const int32_t* w = tile.codes.data() + static_cast<size_t>(b) * 8 * kLaneRows;
    __m512i wk[8];
    for (int k = 0; k < 8; ++k) wk[k] = _mm512_loadu_si512(w + k * kLaneRows);
    const __m512 d = _mm512_loadu_ps(tile.d.data() + static_cast<size_t>(b) * kLaneRows);
    // block b's activations within its quad: the low-nibble elements at 16 (b % 4), the high at 64 + that
    const int8_t* qb = q + static_cast<size_t>(b / 4) * kLaneTokens * 128 + static_cast<size_t>(b % 4) * 16;
    const float* sxb = sx + static_cast<size_t>(b) * kLaneTokens;
    const int32_t* zb = neg_zsum + static_cast<size_t>(b) * kLaneTokens;
    __m512i sum[NT];
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) sum[t] = _mm512_set1_epi32(zb[t]);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
#pragma GCC unroll 16
      for (int t = 0; t < NT; ++t) {
        int32_t lo, hi;
        std::memcpy(&lo, qb + t * 128 + 4 * k, 4);
        std::memcpy(&hi, qb + t * 128 + 64 + 4 * k, 4);
        sum[t] = _mm512_dpbusd_epi32(sum[t], wk[k], _mm512_set1_epi32(lo));
        sum[t] = _mm512_dpbusd_epi32(sum[t], wk[4 + k], _mm512_set1_epi32(hi));
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(d, _mm512_set1_ps(sxb[t])), acc[t]);
  }
  const __mmask16 in = static_cast<__mmask16>(rows >= kLaneRows ? 0xFFFF : (1u << rows) - 1);
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + static_cast<uint64_t>(t0 + t) * ldy + r0, in, acc[t]);
}

// Calls of this many tokens or more take the rows-in-lanes loop: transposing a row tile costs about as much
// as running it against a few tokens (at 4 the row loop was ahead, 60-67 GMAC/s against 56-60; even at 6).
constexpr int kLaneMinTokens = 6;

// f(std::integral_constant<int, nt>{}) for nt in 1..kLaneTokens.
template <typename F>
MOSAIC_VNNI inline void for_lane_tokens(int nt, F&& f) {
  switch (nt) {
    case 12: f(std::integral_constant<int, 12>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// Tokens a prefill step shares a row's unpacked codes among (int8_row_tokens): eight accumulators and eight
// scale vectors fit the 32 registers, and ran 1.05-1.15x four once the tokens were in L1.
constexpr int kVnniTokens = 8;

// Rows per step. Two shared the activation loads and ran 1.1x one row while the scales' misses stalled the
// loop; with the scales prefetched one row is 1.07x two (the same A/B).
constexpr int kVnniRows = 1;

// Q4 (Codes = Q4Codes) or MXFP4 (Mxfp4Codes) against int8 activations.
template <typename Codes>
MOSAIC_VNNI void int8_matvec(const MatvecArgs& a) {
  constexpr bool mx = std::is_same<Codes, Mxfp4Codes>::value;
  thread_local QuantisedX qx;
  const int blocks = (a.cols + kQ4 - 1) / kQ4, quads = (blocks + 3) / 4, groups = (blocks + kGroup - 1) / kGroup;
  quantise_x<Codes>(a, quads, groups, qx);
  const auto* scales = static_cast<const std::conditional_t<mx, uint8_t, uint16_t>*>(a.scales);
  // Lane -> block within a group, for quad k of the group: lanes 4j..4j+3 are block 4k + j.
  __m512i lane_block[kGroup / 4];
  for (int k = 0; k < kGroup / 4; ++k)
    lane_block[k] = _mm512_add_epi32(_mm512_set1_epi32(4 * k),
                                     _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  const int8_t* q0 = qx.q.data();
  const float *sx0 = qx.sx.data(), *off0 = qx.off.data();
  const size_t q_stride = static_cast<size_t>(quads) * 128, s_stride = static_cast<size_t>(groups) * kGroup;
  if (a.n >= kLaneMinTokens) {  // a prefill: 16 rows a vector, a row tile transposed once for every token
    thread_local std::vector<RowTile> tiles;
    thread_local LaneX lx;
    lane_x(qx, a.n, quads, blocks, s_stride, lx);
    // a panel of tiles at a time, each token group run over the panel's tiles (prefill_blocks.h)
    const int panel = detail::prefill_tile_panel(static_cast<size_t>(blocks) * 8 * kLaneRows * sizeof(int32_t),
                                                 lx.q.size());
    if (static_cast<int>(tiles.size()) < panel) tiles.resize(panel);
    for (int p0 = 0; p0 < a.rows; p0 += panel * kLaneRows) {
      const int p1 = std::min(a.rows, p0 + panel * kLaneRows);
      for (int r0 = p0, i = 0; r0 < p1; r0 += kLaneRows, ++i)
        row_tile_codes<Codes>(a, r0, std::min(kLaneRows, p1 - r0), blocks, tiles[i]);
      for (int t = 0; t < a.n; t += kLaneTokens)
        for_lane_tokens(std::min(kLaneTokens, a.n - t), [&](auto tokens) MOSAIC_VNNI {
          for (int r0 = p0, i = 0; r0 < p1; r0 += kLaneRows, ++i)
            row_tile_tokens<decltype(tokens)::value>(tiles[i], blocks, lx, t, r0, std::min(kLaneRows, p1 - r0),
                                                     a.y, a.ldy);
        });
    }
    return;
  }
  if (a.n > 1) {  // a short prefill: each row's codes unpacked once for kVnniTokens tokens at a time
    // Row panels in L2, token tiles in L1 (prefill_blocks.h).
    const int panel = detail::prefill_row_panel(static_cast<size_t>(blocks) * kQ4Bytes);
    auto tile = [&](auto tokens, int r0, int r1, int t) MOSAIC_VNNI {
      constexpr int nt = decltype(tokens)::value;
      for (int r = r0; r < r1; ++r)
        int8_row_tokens<nt, Codes>(a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes,
                                   scales + static_cast<uint64_t>(r) * blocks, blocks, groups, q0 + t * q_stride,
                                   q_stride, sx0 + t * s_stride, off0 + t * s_stride, s_stride, lane_block,
                                   a.y + static_cast<uint64_t>(t) * a.ldy + r, a.ldy);
    };
    for (int r0 = 0; r0 < a.rows; r0 += panel) {
      const int r1 = std::min(a.rows, r0 + panel);
      for (int t = 0; t < a.n; t += kVnniTokens) {
        switch (std::min(kVnniTokens, a.n - t)) {
          case 8: tile(std::integral_constant<int, 8>(), r0, r1, t); break;
          case 7: tile(std::integral_constant<int, 7>(), r0, r1, t); break;
          case 6: tile(std::integral_constant<int, 6>(), r0, r1, t); break;
          case 5: tile(std::integral_constant<int, 5>(), r0, r1, t); break;
          case 4: tile(std::integral_constant<int, 4>(), r0, r1, t); break;
          case 3: tile(std::integral_constant<int, 3>(), r0, r1, t); break;
          case 2: tile(std::integral_constant<int, 2>(), r0, r1, t); break;
          default: tile(std::integral_constant<int, 1>(), r0, r1, t);
        }
      }
    }
    return;
  }
  for (int r = 0; r < a.rows; r += kVnniRows) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const auto* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t = 0; t < a.n; ++t) {
      const int8_t* q = q0 + static_cast<size_t>(t) * quads * 128;
      const size_t b = static_cast<size_t>(t) * groups * kGroup;
      float* y = a.y + static_cast<uint64_t>(t) * a.ldy + r;
      for (int i = 0; i < kVnniRows && r + i < a.rows; ++i) {
        const uint8_t* ri = row + static_cast<uint64_t>(i) * blocks * kQ4Bytes;
        const auto* si = rs + static_cast<uint64_t>(i) * blocks;
        if (a.cols > kL2PrefetchCols)
          q4_vnni_rows<1, _MM_HINT_T1, Codes>(ri, si, blocks, groups, q, sx0 + b, off0 + b, lane_block, y + i);
        else
          q4_vnni_rows<1, _MM_HINT_T0, Codes>(ri, si, blocks, groups, q, sx0 + b, off0 + b, lane_block, y + i);
      }
    }
  }
}

MOSAIC_VNNI void q4_vnni(const MatvecArgs& a) { int8_matvec<Q4Codes>(a); }
MOSAIC_VNNI void mxfp4_vnni(const MatvecArgs& a) { int8_matvec<Mxfp4Codes>(a); }

// MXFP4 in float: a block's 32 codes (byte j: elements 2j and 2j + 1) through the E2M1 table with one
// vpermps per 16, times the block's power-of-two scale.
MOSAIC_AVX512 void mxfp4_avx512(const MatvecArgs& a) {
  const int blocks = (a.cols + kMxfp4 - 1) / kMxfp4;
  const auto* scales = static_cast<const uint8_t*>(a.scales);
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int r = 0; r < a.rows; ++r) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes;
    const uint8_t* rs = scales + static_cast<uint64_t>(r) * blocks;
    for (int t0 = 0; t0 < a.n; t0 += kTokTile) {
      const int nt = std::min(kTokTile, a.n - t0);
      __m512 acc[kTokTile];
      for (int t = 0; t < kTokTile; ++t) acc[t] = _mm512_setzero_ps();
      for (int b = 0; b < blocks; ++b) {
        if ((b & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + b * 16 + kPrefetch), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        const __m512 w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), lut);
        const __m512 d = _mm512_set1_ps(e8m0_to_f32(rs[b]));
        const int c = b * kMxfp4, len = std::min(kMxfp4, a.cols - c);
        const __mmask16 m0 = len >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
        const __mmask16 m1 = len >= 32 ? 0xFFFF : (len <= 16 ? 0 : static_cast<__mmask16>((1u << (len - 16)) - 1));
        for (int t = 0; t < nt; ++t) {
          const float* x = a.x + static_cast<uint64_t>(t0 + t) * a.ldx + c;
          const __m512 dot = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m1, x + 16),
                                             _mm512_mul_ps(w0, _mm512_maskz_loadu_ps(m0, x)));
          acc[t] = _mm512_fmadd_ps(dot, d, acc[t]);
        }
      }
      for (int t = 0; t < nt; ++t) a.y[static_cast<uint64_t>(t0 + t) * a.ldy + r] = reduce(acc[t]);
    }
  }
}

}  // namespace

IsaKernels avx512_kernels() { return {q4_avx512, fp8_avx512, mxfp4_avx512}; }
IsaKernels avx512_vnni_kernels() { return {q4_vnni, fp8_avx512, mxfp4_vnni}; }

}  // namespace mosaic
