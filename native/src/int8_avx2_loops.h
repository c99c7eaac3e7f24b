// The Q4 and MXFP4 loops against int8 activations at AVX2 width, written once for two instruction sets:
// kernels_avx2.cpp (vpmaddubsw + vpmaddwd, any AVX2 CPU) and kernels_avx_vnni.cpp (AVX-VNNI's vpdpbusd).
// A function's target cannot depend on a template parameter, so each includer defines, in its own
// anonymous namespace before including this, MOSAIC_INT8_TARGET (the loops' target) and
// `__m256i pair_dots(lo, ql, hi, qh)`: lane i = the sum of codes x activations over bytes 4i..4i+3 of
// lo x ql plus hi x qh (codes unsigned, activations signed), and `__m256i lane_dots(w, xl, xh)`: lane r = the
// sum over k < 4 of the four codes of row r in w[8 k + r] x activations xl[4k..4k+3], plus w[32 + 8 k + r] x
// xh[4k..4k+3] (rows in lanes; w an int32 array, any alignment). Every sum is exact, so the two files agree
// bit for bit. Internal to native/src; no include guard: included once per instruction set, inside a
// namespace, after <immintrin.h>, <algorithm>, <cstring>, <vector>, mosaic/kernels.h, prefill_blocks.h and
// simd_avx2.h.

// x is quantised once per call to int8 per 32-block (scale sx = amax/127, rounded to nearest even), as the
// VNNI kernel does. 32 bytes of codes are two blocks: their low nibbles (elements 0..15 of each) and high
// nibbles (16..31) meet the activations laid out the same way, [b0 0..15, b1 0..15] then [b0 16..31, b1
// 16..31]. pair_dots sums code x activation products into 8 int32 lanes, four a block, and each lane is
// scaled by d (weight block) * sx (activation block). The codes' offset of 8 is taken out once per block:
// d * 8 * sx * sum(q). Activations lose about 0.4 % (int8); weights are exact.
constexpr int kInt8Group = 8;         // blocks whose scales are converted with one vcvtph2ps
constexpr int kInt8Prefetch = 4096;   // bytes ahead in the row stream
constexpr int kInt8ScalePrefetch = 512;

struct QuantisedX {
  std::vector<int8_t> q;     // [n][pairs * 64]: per pair of blocks, the elements each block's low nibbles hold
                             // (Q4: 0..15; MXFP4: the even ones), then its high nibbles' (16..31; odd)
  std::vector<float> sx;     // [n][groups * 8]: activation scale per block, zero past the last block
  std::vector<float> off;    // [n][groups * 8]: zero * sx * sum(q) per block, zero the codes' offset
};

// The weights' side of the int8 loop, as in kernels_avx512.cpp: Q4's codes are w + 8, low nibbles holding
// elements 0..15; MXFP4's go through a table to 2 * e2m1 + 12, nibbles holding elements 2j and 2j + 1.
struct Q4Codes {
  static constexpr float kZero = 8.f;
  static constexpr bool kMx = false;
};
struct Mxfp4Codes {
  static constexpr float kZero = 12.f;
  static constexpr bool kMx = true;
};

MOSAIC_AVX2 inline __m256 masked_x(const float* x, int len) {  // x[0..len) then zeros, len in 0..8
  if (len >= 8) return _mm256_loadu_ps(x);
  alignas(32) float tmp[8] = {};
  std::memcpy(tmp, x, sizeof(float) * std::max(0, len));
  return _mm256_load_ps(tmp);
}

template <typename Codes>
MOSAIC_AVX2 void quantise_x(const MatvecArgs& a, int pairs, int groups, QuantisedX& out) {
  const size_t per_q = static_cast<size_t>(pairs) * 64, per_b = static_cast<size_t>(groups) * kInt8Group;
  out.q.assign(per_q * a.n, 0);  // capacity is kept across calls: no allocation once warm
  out.sx.assign(per_b * a.n, 0.f);
  out.off.assign(per_b * a.n, 0.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int t = 0; t < a.n; ++t) {
    const float* x = a.x + static_cast<uint64_t>(t) * a.ldx;
    int8_t* q = out.q.data() + per_q * t;
    for (int b = 0; b * kQ4 < a.cols; ++b) {
      const int c0 = b * kQ4, len = std::min(kQ4, a.cols - c0);
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = masked_x(x + c0 + 8 * i, len - 8 * i);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const float sx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m256i iv[4];
      for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));  // nearest even
      // packs work within 128-bit lanes: the permute puts elements 0..31 back in order
      __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3])), order);
      if constexpr (Codes::kMx) {  // even elements, then odd: each lane's evens and odds, then the lanes' quads
        const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                               0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
      }
      int8_t* pair = q + (b / 2) * 64 + (b % 2) * 16;  // the low nibbles' elements, then the high ones'
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(bytes, 1));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      const int sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
      out.sx[per_b * t + b] = sx;
      out.off[per_b * t + b] = Codes::kZero * sx * static_cast<float>(sum);
    }
  }
}

// A group's kInt8Group block scales as floats (nb of them; the rest zero, never read past the row's last):
// Q4's f16, or MXFP4's E8M0 byte moved into the exponent field, halved for the doubled codes.
template <typename Codes, typename Scale>
MOSAIC_AVX2 inline __m256 group_scales(const Scale* group, int nb) {
  alignas(16) Scale tmp[kInt8Group] = {};
  if (nb < kInt8Group) {
    std::memcpy(tmp, group, sizeof(Scale) * nb);
    group = tmp;
  }
  if constexpr (Codes::kMx) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(group)));
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), _mm256_set1_ps(0.5f));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group)));
  }
}

// One row against NT tokens' quantised x (a prefill's). Per 32 bytes of codes (two blocks): one load and
// the two nibble masks, shared by the tokens, then per token its pair_dots, one convert, the scale permute
// and one FMA. One accumulator a token: the tokens' FMA chains interleave, and
// fewer live registers keep them out of the stack (two a token spilled them, and the loop ran at a third
// of its issue rate).
template <int NT, typename Codes, typename Scale>
MOSAIC_INT8_TARGET void int8_row(const uint8_t* row, const Scale* rs, int blocks, int groups, const int8_t* q,
                                 size_t q_stride, const float* sx, const float* off, size_t s_stride, float* y,
                                 int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * kInt8Group, nb = std::min(kInt8Group, blocks - b0);
    _mm_prefetch(reinterpret_cast<const char*>(rs + b0) + kInt8ScalePrefetch, _MM_HINT_T0);
    const __m256 d = group_scales<Codes>(rs + b0, nb);
    __m256 dsx[NT];
    for (int t = 0; t < NT; ++t) {
      dsx[t] = _mm256_mul_ps(d, _mm256_loadu_ps(sx + t * s_stride + b0));
      acc[t] = _mm256_fnmadd_ps(d, _mm256_loadu_ps(off + t * s_stride + b0), acc[t]);
    }
    for (int k = 0; 2 * k < nb; ++k) {
      const int p = b0 / 2 + k;
      const uint8_t* at = row + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(at + kInt8Prefetch), _MM_HINT_T0);
      const __m256i v = 2 * k + 1 < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                       : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (Codes::kMx) lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
      const __m256i lanes = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1);
      for (int t = 0; t < NT; ++t) {
        const int8_t* qt = q + t * q_stride + p * 64;
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qt));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qt + 32));
        const __m256 dot = _mm256_cvtepi32_ps(pair_dots(lo, ql, hi, qh));
        acc[t] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(dsx[t], lanes), acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) y[t * ldy] = avx2::reduce(acc[t]);
}

// One row against one token (a decode step). A group's eight blocks are four steps of 32 code bytes; each
// step's int32 dot products (four lanes a block) are summed to one lane a block with three vphaddd, so a
// group costs one convert, one permute and one FMA where a step each took them. Kept apart from
// int8_row<1>: the compiler schedules this form better.
template <typename Codes, typename Scale>
MOSAIC_INT8_TARGET float int8_row_one(const uint8_t* row, const Scale* rs, int blocks, int groups,
                                      const int8_t* q, const float* sx, const float* off) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  // the vphaddd tree leaves blocks 0, 2, 4, 6 in the low lane and 1, 3, 5, 7 in the high one
  const __m256i block_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // A step's 8 int32 dots: lanes 0-3 its first block, 4-7 its second (zero when the row has no second).
  auto step = [&](int p, bool two) MOSAIC_INT8_TARGET {
    const uint8_t* at = row + p * 32;
    _mm_prefetch(reinterpret_cast<const char*>(at + kInt8Prefetch), _MM_HINT_T0);
    const __m256i v = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                          : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if constexpr (Codes::kMx) lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 64));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 64 + 32));
    return pair_dots(lo, ql, hi, qh);
  };
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int g = 0; g < groups; ++g) {
    const int b0 = g * kInt8Group, nb = std::min(kInt8Group, blocks - b0);
    _mm_prefetch(reinterpret_cast<const char*>(rs + b0) + kInt8ScalePrefetch, _MM_HINT_T0);
    const __m256 d = group_scales<Codes>(rs + b0, nb);
    acc1 = _mm256_fnmadd_ps(d, _mm256_loadu_ps(off + b0), acc1);
    const int p0 = b0 / 2;
    __m256i dots[4];
    if (nb == kInt8Group) {
      for (int k = 0; k < 4; ++k) dots[k] = step(p0 + k, true);
    } else {  // the row's last group
      for (int k = 0; k < 4; ++k) dots[k] = 2 * k < nb ? step(p0 + k, 2 * k + 1 < nb) : _mm256_setzero_si256();
    }
    const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(dots[0], dots[1]), _mm256_hadd_epi32(dots[2], dots[3]));
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(sums, block_order));
    acc0 = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_loadu_ps(sx + b0)), acc0);
  }
  return avx2::reduce(_mm256_add_ps(acc0, acc1));
}

// Tokens a prefill step shares a row's unpacked codes among: four keep every accumulator in the 16 registers.
constexpr int kInt8Tokens = 4;

// --- A prefill with rows in lanes (kernels_avx512.cpp's, eight rows a vector) ---------------------------
// int8_row spends a convert, a scale permute and an FMA a token on every two blocks of every row beside its
// dot products. Here a vector holds 8 rows: a row tile's codes are transposed once (RowTile) so that dword
// group k of a block is one vector of the 8 rows' four codes, and a token's four activations of that group
// are a broadcast operand. A block against a token is then the includer's lane_dots (eight dot steps into
// one int32 sum a row), one convert, one multiply by d * sx and two FMAs (the sum, less the codes' offset),
// for 8 rows x 32 columns.
constexpr int kLaneRows = 8;

struct RowTile {
  std::vector<int32_t> codes;  // [blocks][8 groups][8 rows]: four unsigned codes (w + zero) a dword
  std::vector<float> d;        // [blocks][8 rows]: weight scales (MXFP4's halved: its codes are doubled)
  std::vector<float> rows_d;   // [8 rows][groups * 8]: the scales as converted, before their transpose
};

// Rows [r0, r0 + rows) as a RowTile: a block's 16 code bytes of each row transposed four at a time (rows r
// and r + 4 share a vector, unpacked by dwords then quadwords, as a 4 x 4 transpose in each 128-bit half),
// their low nibbles groups 0-3 (the block's low-nibble elements, as quantise_x lays them) and high nibbles
// groups 4-7. Missing rows repeat row r0; their sums are never stored. (vpgatherdd, one a group, made the
// transpose cost more than the tile's pass against 32 tokens on AMD Zen 3.)
template <typename Codes, typename Scale>
MOSAIC_INT8_TARGET void row_tile_codes(const MatvecArgs& a, int r0, int rows, int blocks, int groups,
                                       RowTile& out) {
  const auto* scales = static_cast<const Scale*>(a.scales);
  out.codes.resize(static_cast<size_t>(blocks) * 8 * kLaneRows);
  out.d.resize(static_cast<size_t>(blocks) * kLaneRows);
  out.rows_d.resize(static_cast<size_t>(kLaneRows) * groups * kInt8Group);
  const size_t row_bytes = static_cast<size_t>(blocks) * kQ4Bytes;
  const uint8_t* row[kLaneRows];
  for (int i = 0; i < kLaneRows; ++i) row[i] = a.codes + static_cast<uint64_t>(r0 + (i < rows ? i : 0)) * row_bytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const size_t d_stride = static_cast<size_t>(groups) * kInt8Group;
  for (int i = 0; i < kLaneRows; ++i) {  // each row's scales as floats, eight at a time
    const Scale* rs = scales + static_cast<uint64_t>(r0 + (i < rows ? i : 0)) * blocks;
    float* d = out.rows_d.data() + i * d_stride;
    for (int g = 0; g < groups; ++g) {
      const int b0 = g * kInt8Group;
      _mm256_storeu_ps(d + b0, group_scales<Codes>(rs + b0, std::min(kInt8Group, blocks - b0)));
    }
  }
  auto load = [&](int lo_row, int b) MOSAIC_INT8_TARGET {  // rows lo_row and lo_row + 4, block b
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[lo_row] + b * kQ4Bytes))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[lo_row + 4] + b * kQ4Bytes)), 1);
  };
  for (int b = 0; b < blocks; ++b) {
    const __m256i a0 = load(0, b), a1 = load(1, b), a2 = load(2, b), a3 = load(3, b);
    const __m256i t0 = _mm256_unpacklo_epi32(a0, a1), t1 = _mm256_unpackhi_epi32(a0, a1);
    const __m256i t2 = _mm256_unpacklo_epi32(a2, a3), t3 = _mm256_unpackhi_epi32(a2, a3);
    // dword m of the block, rows 0-3 in the low half and 4-7 in the high: lane order is row order
    const __m256i dw[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                           _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    int32_t* w = out.codes.data() + static_cast<size_t>(b) * 8 * kLaneRows;
    for (int m = 0; m < 4; ++m) {
      __m256i lo = _mm256_and_si256(dw[m], low4), hi = _mm256_and_si256(_mm256_srli_epi32(dw[m], 4), low4);
      if constexpr (Codes::kMx) lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + m * kLaneRows), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + (4 + m) * kLaneRows), hi);
    }
    for (int i = 0; i < kLaneRows; ++i) out.d[static_cast<size_t>(b) * kLaneRows + i] = out.rows_d[i * d_stride + b];
  }
}

// A row tile's 8 rows against tokens [t0, t0 + NT): y[t][r0 + lane] for the first `rows` lanes.
template <int NT>
MOSAIC_INT8_TARGET void row_tile_tokens(const RowTile& tile, int blocks, const QuantisedX& qx, size_t q_stride,
                                        size_t s_stride, int t0, int r0, int rows, float* y, int64_t ldy) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const int32_t* w = tile.codes.data() + static_cast<size_t>(b) * 8 * kLaneRows;
    const __m256 d = _mm256_loadu_ps(tile.d.data() + static_cast<size_t>(b) * kLaneRows);
    // block b's activations within its pair: the low-nibble elements at 16 (b % 2), the high at 32 + that
    const size_t at = static_cast<size_t>(b / 2) * 64 + static_cast<size_t>(b % 2) * 16;
    for (int t = 0; t < NT; ++t) {
      const int8_t* q = qx.q.data() + static_cast<size_t>(t0 + t) * q_stride + at;
      const size_t s = static_cast<size_t>(t0 + t) * s_stride + b;
      const __m256 dot = _mm256_cvtepi32_ps(lane_dots(w, q, q + 32));
      acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(qx.sx[s])), acc[t]);
      acc[t] = _mm256_fnmadd_ps(d, _mm256_set1_ps(qx.off[s]), acc[t]);
    }
  }
  alignas(32) float out[kLaneRows];
  for (int t = 0; t < NT; ++t) {
    _mm256_store_ps(out, acc[t]);
    std::memcpy(y + static_cast<uint64_t>(t0 + t) * ldy + r0, out, sizeof(float) * rows);
  }
}

// Tokens a row tile's pass takes at once: six accumulators live across the blocks (eight spilled, and ran
// 0.75-0.9x six), and the calls that take the rows-in-lanes loop at all: at 8 tokens the two loops were even
// (`MOSAIC_ISA=avx2 python benchmarks/matvec_bench.py --tokens 8`, AMD Zen 3), at 12 this one ran 1.2x.
constexpr int kLaneTokens = 6;
constexpr int kLaneMinTokens = 8;

// Q4 (f16 scales) or MXFP4 (E8M0 scales) against int8 activations.
template <typename Codes, typename Scale>
MOSAIC_INT8_TARGET void int8_matvec(const MatvecArgs& a) {
  thread_local QuantisedX qx;
  const int blocks = (a.cols + kQ4 - 1) / kQ4, pairs = (blocks + 1) / 2;
  const int groups = (blocks + kInt8Group - 1) / kInt8Group;
  quantise_x<Codes>(a, pairs, groups, qx);
  const auto* scales = static_cast<const Scale*>(a.scales);
  if (a.n == 1) {
    for (int r = 0; r < a.rows; ++r)
      a.y[r] = int8_row_one<Codes>(a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes,
                                   scales + static_cast<uint64_t>(r) * blocks, blocks, groups, qx.q.data(),
                                   qx.sx.data(), qx.off.data());
    return;
  }
  const size_t q_stride = static_cast<size_t>(pairs) * 64, s_stride = static_cast<size_t>(groups) * kInt8Group;
  if (a.n >= kLaneMinTokens) {  // a prefill: 8 rows a vector, a row tile transposed once for every token
    thread_local RowTile tile;
    for (int r0 = 0; r0 < a.rows; r0 += kLaneRows) {
      const int rows = std::min(kLaneRows, a.rows - r0);
      row_tile_codes<Codes, Scale>(a, r0, rows, blocks, groups, tile);
      for (int t = 0; t < a.n; t += kLaneTokens) {
        switch (std::min(kLaneTokens, a.n - t)) {
          case 6: row_tile_tokens<6>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy); break;
          case 5: row_tile_tokens<5>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy); break;
          case 4: row_tile_tokens<4>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy); break;
          case 3: row_tile_tokens<3>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy); break;
          case 2: row_tile_tokens<2>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy); break;
          default: row_tile_tokens<1>(tile, blocks, qx, q_stride, s_stride, t, r0, rows, a.y, a.ldy);
        }
      }
    }
    return;
  }
  // A short prefill: row panels in L2, token tiles in L1 (prefill_blocks.h).
  const int panel = detail::prefill_row_panel(static_cast<size_t>(blocks) * kQ4Bytes);
  auto tile = [&](auto tokens, int r0, int r1, int t) MOSAIC_INT8_TARGET {
    constexpr int nt = decltype(tokens)::value;
    for (int r = r0; r < r1; ++r)  // the tile's tokens share each row's unpacked codes
      int8_row<nt, Codes>(a.codes + static_cast<uint64_t>(r) * blocks * kQ4Bytes,
                          scales + static_cast<uint64_t>(r) * blocks, blocks, groups, qx.q.data() + t * q_stride,
                          q_stride, qx.sx.data() + t * s_stride, qx.off.data() + t * s_stride, s_stride,
                          a.y + static_cast<uint64_t>(t) * a.ldy + r, a.ldy);
  };
  for (int r0 = 0; r0 < a.rows; r0 += panel) {
    const int r1 = std::min(a.rows, r0 + panel);
    for (int t = 0; t < a.n; t += kInt8Tokens) {
      switch (std::min(kInt8Tokens, a.n - t)) {
        case 4: tile(std::integral_constant<int, 4>(), r0, r1, t); break;
        case 3: tile(std::integral_constant<int, 3>(), r0, r1, t); break;
        case 2: tile(std::integral_constant<int, 2>(), r0, r1, t); break;
        default: tile(std::integral_constant<int, 1>(), r0, r1, t);
      }
    }
  }
}
