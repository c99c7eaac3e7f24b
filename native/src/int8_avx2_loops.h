// The Q4 and MXFP4 loops against int8 activations at AVX2 width, written once for two instruction sets:
// kernels_avx2.cpp (vpmaddubsw + vpmaddwd, any AVX2 CPU) and kernels_avx_vnni.cpp (AVX-VNNI's vpdpbusd).
// A function's target cannot depend on a template parameter, so each includer defines, in its own
// anonymous namespace before including this, MOSAIC_INT8_TARGET (the loops' target) and
// `__m256i pair_dots(lo, ql, hi, qh)`: lane i = the sum of codes x activations over bytes 4i..4i+3 of
// lo x ql plus hi x qh (codes unsigned, activations signed), and `block_dots<NT, Mx>(w, q, neg_zsum, sum)` for
// NT up to `kLaneTokens<Mx>`: lane r of sum[t] = neg_zsum[t] plus the sum over k < 8 of the four codes of row r
// in w[8 k + r] x activations q[32 t + 4 k..32 t + 4 k + 3] (rows in lanes; w an int32 array, any alignment;
// Mx: MXFP4's codes, up to 24). Every sum is exact, so the two files agree
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
  std::vector<int32_t> zsum; // [n][groups * 8]: zero * sum(q) per block, the offset as the lane loop takes it
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
  out.zsum.assign(per_b * a.n, 0);
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
      out.zsum[per_b * t + b] = static_cast<int32_t>(Codes::kZero) * sum;
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
// are a broadcast operand. A block against a token is then eight dot steps into one int32 sum a row, less
// the codes' offset, one convert, one multiply by d * sx and one FMA, for 8 rows x 32 columns.
constexpr int kLaneRows = 8;

struct RowTile {
  std::vector<int32_t> codes;  // [blocks][8 groups][8 rows]: four unsigned codes (w + zero) a dword
  std::vector<float> d;        // [groups * 8 blocks][8 rows]: weight scales (MXFP4's halved: its codes are doubled)
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
  out.d.resize(static_cast<size_t>(groups) * kInt8Group * kLaneRows);  // whole groups: the transpose writes 8 blocks
  const size_t row_bytes = static_cast<size_t>(blocks) * kQ4Bytes;
  const uint8_t* row[kLaneRows];
  const Scale* row_scales[kLaneRows];
  for (int i = 0; i < kLaneRows; ++i) {
    const uint64_t r = static_cast<uint64_t>(r0 + (i < rows ? i : 0));
    row[i] = a.codes + r * row_bytes, row_scales[i] = scales + r * blocks;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // 2 * e2m1 + 12 by code, in each 128-bit lane for vpshufb
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  for (int g = 0; g < groups; ++g) {  // a group's 8 blocks of the 8 rows' scales, as floats, transposed
    const int b0 = g * kInt8Group, nb = std::min(kInt8Group, blocks - b0);
    __m256 d[kLaneRows];
    for (int i = 0; i < kLaneRows; ++i) d[i] = group_scales<Codes>(row_scales[i] + b0, nb);
    avx2::transpose8(d);
    for (int j = 0; j < kInt8Group; ++j) _mm256_storeu_ps(out.d.data() + static_cast<size_t>(b0 + j) * kLaneRows, d[j]);
  }
  auto load = [&](int lo_row, int b) MOSAIC_INT8_TARGET {  // rows lo_row and lo_row + 4, block b
    return _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[lo_row] + b * kQ4Bytes))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[lo_row + 4] + b * kQ4Bytes)), 1);
  };
  const detail::NextTile next(a.codes, a.scales, row_bytes, blocks * sizeof(Scale), r0 + kLaneRows, kLaneRows, a.rows,
                              blocks);
  for (int b = 0; b < blocks; ++b) {
    for (size_t l = next.lines_before(b), e = next.lines_before(b + 1); l < e; ++l)
      _mm_prefetch(next.line(l), _MM_HINT_T1);
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
  }
}

// Calls of this many tokens or more take the rows-in-lanes loop: at 5-7 it ran 1.04-1.5x the row loop, at
// 2-4 no better (`matvec` of the bench shapes alternated between the two builds, on an Intel Xeon forced to
// each of avx2-int8 and avx-vnni).
constexpr int kLaneMinTokens = 5;

// The activations as the rows-in-lanes loop reads them (kernels_avx512.cpp's LaneX at AVX2 width): tokens in
// groups of the includer's kLaneTokens<Mx> and, within a group, each block's activations of every token side by
// side, so that one address a block serves the group and a code vector, loaded once, meets every token of it.
struct LaneX {
  std::vector<int8_t> q;          // [token groups][blocks][group][32]: the low-nibble elements, then the high
  std::vector<float> sx;          // [token groups][blocks][group]
  std::vector<int32_t> neg_zsum;  // [token groups][blocks][group]: minus QuantisedX::zsum
  int group = 0;                  // tokens a group
  size_t q_group = 0, s_group = 0;  // a token group's share of q, and of sx and neg_zsum
};

MOSAIC_INT8_TARGET void lane_x(const QuantisedX& qx, int n, int group, int blocks, size_t q_stride, size_t s_stride,
                               LaneX& out) {
  const int groups = (n + group - 1) / group;
  out.group = group;
  const size_t s_group = out.s_group = static_cast<size_t>(blocks) * group;
  const size_t q_group = out.q_group = s_group * 32;
  out.q.assign(q_group * groups, 0);  // capacity is kept across calls; padding tokens' sums are never stored
  out.sx.assign(s_group * groups, 0.f);
  out.neg_zsum.assign(s_group * groups, 0);
  for (int t = 0; t < n; ++t) {
    const size_t g = static_cast<size_t>(t / group), i = static_cast<size_t>(t % group);
    for (int b = 0; b < blocks; ++b) {
      const int8_t* src = qx.q.data() + t * q_stride + static_cast<size_t>(b / 2) * 64 + (b % 2) * 16;
      const size_t at = g * s_group + static_cast<size_t>(b) * group + i;
      std::memcpy(out.q.data() + at * 32, src, 16);
      std::memcpy(out.q.data() + at * 32 + 16, src + 32, 16);
      out.sx[at] = qx.sx[t * s_stride + b];
      out.neg_zsum[at] = -qx.zsum[t * s_stride + b];
    }
  }
}

// A row tile's 8 rows against the NT tokens of one LaneX group starting at token t0: y[t][r0 + lane] for the
// first `rows` lanes. A block is the includer's block_dots (the exact integer sums, less the codes' offset),
// then per token one convert, one multiply by d * sx and one FMA.
template <int NT, typename Codes>
MOSAIC_INT8_TARGET void row_tile_tokens(const RowTile& tile, int blocks, const LaneX& lx, int t0, int r0, int rows,
                                        float* y, int64_t ldy) {
  const size_t g = static_cast<size_t>(t0 / lx.group);
  const int8_t* q = lx.q.data() + g * lx.q_group;
  const float* sx = lx.sx.data() + g * lx.s_group;
  const int32_t* neg_zsum = lx.neg_zsum.data() + g * lx.s_group;
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const int32_t* w = tile.codes.data() + static_cast<size_t>(b) * 8 * kLaneRows;
    const size_t at = static_cast<size_t>(b) * lx.group;
    __m256i sum[NT];
    block_dots<NT, Codes::kMx>(w, q + at * 32, neg_zsum + at, sum);
    const __m256 d = _mm256_loadu_ps(tile.d.data() + static_cast<size_t>(b) * kLaneRows);
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_mul_ps(d, _mm256_set1_ps(sx[at + t])), acc[t]);
  }
  alignas(32) float out[kLaneRows];
  for (int t = 0; t < NT; ++t) {
    _mm256_store_ps(out, acc[t]);
    std::memcpy(y + static_cast<uint64_t>(t0 + t) * ldy + r0, out, sizeof(float) * rows);
  }
}

// f(std::integral_constant<int, nt>{}) for nt in 1..Max.
template <int Max, typename F>
MOSAIC_INT8_TARGET inline void with_tokens(int nt, F&& f) {
  if constexpr (Max > 1) {
    if (nt == Max) f(std::integral_constant<int, Max>{});
    else with_tokens<Max - 1>(nt, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// A prefill with rows in lanes: every row tile transposed once, a panel of them at a time (prefill_blocks.h),
// then each token group run over the panel's tiles.
template <typename Codes, typename Scale>
MOSAIC_INT8_TARGET void lane_prefill(const MatvecArgs& a, const QuantisedX& qx, int blocks, int groups,
                                     size_t q_stride, size_t s_stride, std::vector<RowTile>& tiles, LaneX& lx) {
  constexpr int group = kLaneTokens<Codes::kMx>;
  lane_x(qx, a.n, group, blocks, q_stride, s_stride, lx);
  const int panel = detail::prefill_tile_panel(static_cast<size_t>(blocks) * 8 * kLaneRows * sizeof(int32_t),
                                               lx.q.size());
  if (static_cast<int>(tiles.size()) < panel) tiles.resize(panel);
  for (int p0 = 0; p0 < a.rows; p0 += panel * kLaneRows) {
    const int p1 = std::min(a.rows, p0 + panel * kLaneRows);
    for (int r0 = p0, i = 0; r0 < p1; r0 += kLaneRows, ++i)
      row_tile_codes<Codes, Scale>(a, r0, std::min(kLaneRows, p1 - r0), blocks, groups, tiles[i]);
    for (int t = 0; t < a.n; t += group)
      with_tokens<group>(std::min(group, a.n - t), [&](auto tokens) MOSAIC_INT8_TARGET {
        for (int r0 = p0, i = 0; r0 < p1; r0 += kLaneRows, ++i)
          row_tile_tokens<decltype(tokens)::value, Codes>(tiles[i], blocks, lx, t, r0, std::min(kLaneRows, p1 - r0),
                                                          a.y, a.ldy);
      });
  }
}

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
    thread_local std::vector<RowTile> tiles_buffer;
    thread_local LaneX lx_buffer;
    std::vector<RowTile>* tiles = &tiles_buffer;
    LaneX* lx = &lx_buffer;
    // Opaque to the optimiser: knowing them for thread_locals, GCC re-derived their addresses (a call to
    // __tls_get_addr, the shared library's TLS model) at every access in the tile loop, spilling the sums.
    __asm__("" : "+r"(tiles), "+r"(lx));
    lane_prefill<Codes, Scale>(a, qx, blocks, groups, q_stride, s_stride, *tiles, *lx);
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
