// Q4 and MXFP4 prefills on AMX-INT8 tiles (Isa::Amx: Xeons from Sapphire Rapids). A tile multiply takes
// 16 weight rows x one 32-block of signed codes (Q4: w = code - 8; MXFP4: 2 * e2m1) against the same block
// of 16 tokens' int8 activations, quantised exactly as the VNNI loop quantises them, into 16 x 16 int32
// sums; AVX-512 then scales each sum by d (weight block) * sx (activation block) into float accumulators,
// one vector of 16 tokens per weight row. Signed codes need no offset term. Calls of fewer than kMinTokens
// tokens (a decode step) and FP8 run the AVX-512 VNNI kernels.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "mosaic/kernels.h"

#include "simd_avx512.h"

namespace mosaic {

namespace {

#define MOSAIC_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int kTile = 16;      // weight rows, and tokens, a tile multiply covers
constexpr int kBlockBytes = kTile * kQ4;  // one block's int8 for a tile's rows (A) or tokens (B): 512 bytes
// Fewer tokens than this run the VNNI loop: a tile's unused token columns cost as much as used ones, and the
// two ran about even at 10-12 tokens, AMX 1.0-1.5x faster at 16 (benchmarks/matvec_bench.py, one thread).
constexpr int kMinTokens = 12;
// Tokens whose tiled activations (a byte a column) are kept in L2 while every row tile runs against them.
constexpr size_t kTokenBlockBytes = 768 << 10;

struct Q4Codes {
  static constexpr bool kMx = false;  // codes are w + 8; low nibbles hold elements 0..15, high ones 16..31
};
struct Mxfp4Codes {
  static constexpr bool kMx = true;   // E2M1 codes; low nibbles hold the even elements, high ones the odd
};

// Tiles 0-3 hold C (16 rows x 16 tokens of int32), 4 and 5 A (16 rows x 32 codes), 6 and 7 B (8 rows of 16
// tokens x 4 activations). Blocks go in pairs, two pairs in flight: the tile unit multiplies one pair while
// AVX-512 scales the one before.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig tile_config() {
  TileConfig c;
  for (int t : {0, 1, 2, 3}) c.colsb[t] = kTile * 4, c.rows[t] = kTile;
  for (int t : {4, 5}) c.colsb[t] = kQ4, c.rows[t] = kTile;
  for (int t : {6, 7}) c.colsb[t] = kTile * 4, c.rows[t] = kQ4 / 4;
  return c;
}

struct TiledX {
  std::vector<int8_t> b;   // [token tile][tiled blocks][8][16 tokens x 4]: B tiles, zero past the last token
  std::vector<float> sx;   // [token tile][tiled blocks][16 tokens]: activation scales, zero past the last token
};

struct TiledW {
  std::vector<int8_t> codes;  // [tiled blocks][16 rows][32]: A tiles of signed codes, zero past the last row
  std::vector<float> d;       // [16 rows][tiled blocks]: weight scales (MXFP4's halved: its codes are doubled)
};

// Tokens [t0, t1) quantised per 32-block to int8 as the VNNI loop quantises them (quantise_block, sx = amax /
// 127) and laid out as B tiles: byte j of dword k of token t's block goes to row k, column 4 t + j. MXFP4's
// blocks go evens then odds, the order of its codes' nibbles. Blocks past `blocks` (up to `tiled`) stay zero.
template <typename Codes>
MOSAIC_AMX void tile_x(const MatvecArgs& a, int t0, int t1, int blocks, int tiled, TiledX& out) {
  const int tiles = (t1 - t0 + kTile - 1) / kTile;
  out.b.assign(static_cast<size_t>(tiles) * tiled * kBlockBytes, 0);  // capacity kept: no allocation once warm
  out.sx.assign(static_cast<size_t>(tiles) * tiled * kTile, 0.f);
  for (int t = t0; t < t1; ++t) {
    const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
    const int tile = (t - t0) / kTile, lane = (t - t0) % kTile;
    for (int b = 0; b < blocks; ++b) {
      const int c0 = b * kQ4;
      __m512i v0, v1;
      const float amax = quantise_block<Codes::kMx>(x + c0, std::min(kQ4, a.cols - c0), v0, v1);
      alignas(32) int32_t dwords[8];  // the block's 32 int8, four a dword
      _mm_store_si128(reinterpret_cast<__m128i*>(dwords), _mm512_cvtsepi32_epi8(v0));
      _mm_store_si128(reinterpret_cast<__m128i*>(dwords + 4), _mm512_cvtsepi32_epi8(v1));
      const size_t at = static_cast<size_t>(tile) * tiled + b;
      int8_t* tb = out.b.data() + at * kBlockBytes + lane * 4;
      for (int k = 0; k < kQ4 / 4; ++k) std::memcpy(tb + k * kTile * 4, dwords + k, 4);
      out.sx[at * kTile + lane] = amax / 127.f;
    }
  }
}

// Rows [r0, r0 + 16) as A tiles of signed codes and their scales as floats; rows past `rows` are zero. A
// row's codes go four blocks to a 64-byte load: the nibbles masked apart and made signed, then each block's
// low and high halves paired into the 32 bytes of its tile row. At a prefill's 16-32 tokens an expert, this
// unpacking was most of the call (one block at a time in 128-bit ops: 78-87 GMAC/s at 16 tokens, 226-266
// with it skipped), since a row tile meets only one or two token tiles.
template <typename Codes>
MOSAIC_AMX void tile_w(const MatvecArgs& a, int r0, int blocks, int tiled, TiledW& out) {
  using Scale = std::conditional_t<Codes::kMx, uint8_t, uint16_t>;
  const auto* scales = static_cast<const Scale*>(a.scales);
  const int rows = std::min(kTile, a.rows - r0);
  out.codes.resize(static_cast<size_t>(tiled) * kBlockBytes);  // capacity kept: no allocation once warm
  out.d.resize(static_cast<size_t>(kTile) * tiled);
  // What no real row's blocks write: the rows past `rows`, and an odd row's zero block that ends its last pair.
  for (int b = 0; b < tiled; ++b) {
    int8_t* tb = out.codes.data() + static_cast<size_t>(b) * kBlockBytes;
    if (b >= blocks) std::memset(tb, 0, kBlockBytes);
    else if (rows < kTile) std::memset(tb + rows * kQ4, 0, static_cast<size_t>(kTile - rows) * kQ4);
  }
  std::fill(out.d.begin(), out.d.end(), 0.f);
  const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  const __m512i e2m1x2 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12));
  // 64-bit lanes of lo (0-7) and hi (8-15): blocks 0 and 1 as lo, hi pairs, then blocks 2 and 3
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  auto signed_codes = [&](__m512i v, __m512i& lo, __m512i& hi) MOSAIC_AMX {
    lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (Codes::kMx) {
      lo = _mm512_shuffle_epi8(e2m1x2, lo), hi = _mm512_shuffle_epi8(e2m1x2, hi);
    } else {
      lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
    }
  };
  for (int i = 0; i < rows; ++i) {
    const uint8_t* row = a.codes + static_cast<uint64_t>(r0 + i) * blocks * kQ4Bytes;
    const Scale* rs = scales + static_cast<uint64_t>(r0 + i) * blocks;
    int8_t* at = out.codes.data() + i * kQ4;
    int b = 0;
    for (; b + 4 <= blocks; b += 4) {
      __m512i lo, hi;
      signed_codes(_mm512_loadu_si512(row + b * kQ4Bytes), lo, hi);
      const __m512i p01 = _mm512_permutex2var_epi64(lo, first, hi), p23 = _mm512_permutex2var_epi64(lo, second, hi);
      int8_t* tb = at + static_cast<size_t>(b) * kBlockBytes;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb), _mm512_castsi512_si256(p01));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb + kBlockBytes), _mm512_extracti64x4_epi64(p01, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb + 2 * kBlockBytes), _mm512_castsi512_si256(p23));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tb + 3 * kBlockBytes), _mm512_extracti64x4_epi64(p23, 1));
    }
    for (; b < blocks; ++b) {  // the row's last 1-3 blocks, one at a time
      __m512i lo, hi;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kQ4Bytes));
      signed_codes(_mm512_castsi128_si512(v), lo, hi);
      int8_t* tb = at + static_cast<size_t>(b) * kBlockBytes;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tb), _mm512_castsi512_si128(lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(tb + 16), _mm512_castsi512_si128(hi));
    }
    float* d = out.d.data() + static_cast<size_t>(i) * tiled;
    for (b = 0; b < blocks; b += kTile) {  // sixteen scales at a time, the last ones masked
      const __mmask16 in = static_cast<__mmask16>(blocks - b >= kTile ? 0xFFFF : (1u << (blocks - b)) - 1);
      __m512 v;
      if constexpr (Codes::kMx) {  // E8M0 as 2^(s - 127) / 2, its exponent field moved into place (s = 0: 0)
        const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(in, rs + b));
        v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f));
      } else {
        v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, rs + b));
      }
      _mm512_mask_storeu_ps(d + b, in, v);
    }
  }
}

// acc[i] (16 tokens of row i) += d[i * stride] * sx * the int32 sums c holds.
MOSAIC_AMX inline void scale_sums(const int32_t* c, const float* d, int stride, __m512 sx, __m512* acc) {
#pragma GCC unroll 16
  for (int i = 0; i < kTile; ++i)
    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * kTile)), sx),
                             _mm512_set1_ps(d[i * stride]), acc[i]);
}

// issue_pair_C0C1: a pair of blocks (A tiles at wa, B tiles at xb) multiplied into tiles C0 and C1.
// retire_pair_C0C1: their sums stored and scaled (weight scales wd, a row's `stride` apart, activation
// scales sx) into acc. The _tile_ intrinsics take tile numbers as literal tokens (GCC spells them into
// inline assembly), so the helpers are stamped out per pair of C tiles.
#define MOSAIC_TILE_PAIR(C0, C1)                                                                            \
  MOSAIC_AMX inline void issue_pair_##C0##C1(const int8_t* wa, const int8_t* xb) {                         \
    _tile_zero(C0);                                                                                         \
    _tile_loadd(4, wa, kQ4);                                                                                \
    _tile_loadd(6, xb, kTile * 4);                                                                          \
    _tile_dpbssd(C0, 4, 6);                                                                                 \
    _tile_zero(C1);                                                                                         \
    _tile_loadd(5, wa + kBlockBytes, kQ4);                                                                  \
    _tile_loadd(7, xb + kBlockBytes, kTile * 4);                                                            \
    _tile_dpbssd(C1, 5, 7);                                                                                 \
  }                                                                                                         \
  MOSAIC_AMX inline void retire_pair_##C0##C1(int32_t* c, const float* wd, int stride, const float* sx,       \
                                              __m512* acc) {                                                \
    _tile_stored(C0, c, kTile * 4);                                                                         \
    scale_sums(c, wd, stride, _mm512_loadu_ps(sx), acc);                                                    \
    _tile_stored(C1, c + kTile * kTile, kTile * 4);                                                         \
    scale_sums(c + kTile * kTile, wd + 1, stride, _mm512_loadu_ps(sx + kTile), acc);                        \
  }
MOSAIC_TILE_PAIR(0, 1)
MOSAIC_TILE_PAIR(2, 3)
#undef MOSAIC_TILE_PAIR

// One row tile (A tiles wa, scales wd, `rows` of them real) against the token tiles of tokens [t0, t1) (B
// tiles xb, scales sx), as one stream of items (token tile, pair of blocks) in B's order: item k + 1 is
// multiplied while item k is scaled, across token tiles too, so the tile unit never drains. A token tile's
// sums go to y once its last pair is in.
MOSAIC_AMX void row_tile(const int8_t* wa, const float* wd, const int8_t* xb, const float* sx, int pairs, int t0,
                         int t1, int r0, int rows, float* y, int64_t ldy) {
  const int tiled = 2 * pairs;  // a row's scales, wd's stride
  alignas(64) int32_t c[2 * kTile * kTile];
  alignas(64) float sums[kTile * kTile];
  __m512 acc[kTile];
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
  const int items = pairs * ((t1 - t0 + kTile - 1) / kTile);
  int issue_pair = 0, retire_pair = 0, tok0 = t0;  // the pairs of the next item to issue and to retire
  auto next_a = [&] {
    const int8_t* at = wa + static_cast<size_t>(issue_pair) * 2 * kBlockBytes;
    issue_pair = issue_pair + 1 == pairs ? 0 : issue_pair + 1;
    return at;
  };
  auto b_of = [&](int k) { return xb + static_cast<size_t>(k) * 2 * kBlockBytes; };
  auto s_of = [&](int k) { return sx + static_cast<size_t>(k) * 2 * kTile; };
  auto d_next = [&] { return wd + static_cast<size_t>(retire_pair) * 2; };
  auto retired = [&]() MOSAIC_AMX {  // after an item's retire: its token tile's sums out, if complete
    if (++retire_pair < pairs) return;
    retire_pair = 0;
    const int toks = std::min(kTile, t1 - tok0);
    for (int i = 0; i < kTile; ++i) {
      _mm512_store_ps(sums + i * kTile, acc[i]);
      acc[i] = _mm512_setzero_ps();
    }
    for (int t = 0; t < toks; ++t)
      for (int i = 0; i < rows; ++i) y[static_cast<uint64_t>(tok0 + t) * ldy + r0 + i] = sums[i * kTile + t];
    tok0 += kTile;
  };
  issue_pair_01(next_a(), b_of(0));
  for (int k = 0;;) {  // item k is in flight in tiles 0 and 1
    if (k + 1 < items) issue_pair_23(next_a(), b_of(k + 1));
    retire_pair_01(c, d_next(), tiled, s_of(k), acc);
    retired();
    if (++k == items) break;
    // item k is in flight in tiles 2 and 3
    if (k + 1 < items) issue_pair_01(next_a(), b_of(k + 1));
    retire_pair_23(c, d_next(), tiled, s_of(k), acc);
    retired();
    if (++k == items) break;
  }
}

template <typename Codes>
MOSAIC_AMX void amx_matvec(const MatvecArgs& a, MatvecFn vnni) {
  if (a.n < kMinTokens || a.rows <= 0 || a.cols <= 0) return vnni(a);
  thread_local TiledX tx;
  thread_local TiledW tw;
  static const TileConfig config = tile_config();
  _tile_loadconfig(&config);  // per call: the tile state is this thread's, released below
  const int blocks = (a.cols + kQ4 - 1) / kQ4;
  const int pairs = (blocks + 1) / 2, tiled = 2 * pairs;  // an odd row's last pair ends in a zero block
  const int block_tokens = std::max<int>(kTile, static_cast<int>(kTokenBlockBytes / (tiled * kQ4)) / kTile * kTile);
  for (int t0 = 0; t0 < a.n; t0 += block_tokens) {
    const int t1 = std::min(a.n, t0 + block_tokens);
    tile_x<Codes>(a, t0, t1, blocks, tiled, tx);
    for (int r0 = 0; r0 < a.rows; r0 += kTile) {  // each row tile unpacked once a token block (hundreds)
      tile_w<Codes>(a, r0, blocks, tiled, tw);
      row_tile(tw.codes.data(), tw.d.data(), tx.b.data(), tx.sx.data(), pairs, t0, t1, r0,
               std::min(kTile, a.rows - r0), a.y, a.ldy);
    }
  }
  _tile_release();
}

void q4_amx(const MatvecArgs& a) {
  static const MatvecFn vnni = avx512_vnni_kernels().q4;
  amx_matvec<Q4Codes>(a, vnni);
}
void mxfp4_amx(const MatvecArgs& a) {
  static const MatvecFn vnni = avx512_vnni_kernels().mxfp4;
  amx_matvec<Mxfp4Codes>(a, vnni);
}

}  // namespace

IsaKernels amx_kernels() { return {q4_amx, avx512_vnni_kernels().fp8, mxfp4_amx}; }

}  // namespace mosaic
