// Y[n, rows] = X[n, cols] @ W.T for a backbone matrix quantised at load: int8 or FP8 (E4M3) codes with
// one float32 scale per output row. Activations stay float32 and every code widens to float exactly, so
// the only error is the weights' quantisation; half the bytes of bf16, for a kernel that is memory-bound.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#include "mosaic/kernels.h"
#include "simd_avx512.h"

namespace mosaic {
namespace {

constexpr int kTile = 4;

// 16 codes widened to float: int8 exactly; E4M3 through f16 (e4m3x16: the value times 2^-8, undone by
// the 256 in the scale).
MOSAIC_AVX512 inline __m512 widen_i8(const uint8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

template <int NT, bool Fp8>
MOSAIC_AVX512 void row_avx512(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  // Four accumulators per token over 64 codes a step: independent FMA chains, so the loop is bound by
  // loads, not by FMA latency.
  __m512 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm512_setzero_ps();
  int c = 0;
  for (; c + 64 <= cols; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c + 1024), _MM_HINT_T0);
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = Fp8 ? e4m3x16(w + c + 16 * j, 0xFFFF) : widen_i8(w + c + 16 * j, 0xFFFF);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j] = _mm512_fmadd_ps(wv[j], _mm512_loadu_ps(x + t * ldx + c + 16 * j), acc[t][j]);
  }
  for (; c < cols; c += 16) {
    const int len = std::min(16, cols - c);
    const __mmask16 m = len == 16 ? 0xFFFF : static_cast<__mmask16>((1u << len) - 1);
    const __m512 wv = Fp8 ? e4m3x16(w + c, m) : widen_i8(w + c, m);
    for (int t = 0; t < NT; ++t) acc[t][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + t * ldx + c), acc[t][0]);
  }
  for (int t = 0; t < NT; ++t)
    y[t * ldy] = scale * _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                                            _mm512_add_ps(acc[t][2], acc[t][3])));
}

#include "simd_avx2.h"

// 8 codes widened to float, as widen_i8 / e4m3x16 do at 16.
MOSAIC_AVX2 inline __m256 widen8_avx2(const uint8_t* p, bool fp8) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (!fp8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  const __m128i h16 = _mm_cvtepu8_epi16(b);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h16, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(h16, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}

// AVX2: row_avx512 at half width (32 codes a step, four accumulators per token); the tail through the
// scalar arithmetic.
template <int NT, bool Fp8>
MOSAIC_AVX2 void row_avx2(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  __m256 acc[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_ps();
  int c = 0;
  for (; c + 32 <= cols; c += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c + 1024), _MM_HINT_T0);
    __m256 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = widen8_avx2(w + c + 8 * j, Fp8);
    for (int t = 0; t < NT; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * ldx + c + 8 * j), acc[t][j]);
  }
  for (int t = 0; t < NT; ++t) {
    const __m256 v = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    if (Fp8) s *= 256.f;  // the f16 route's 2^-8, undone before the exact tail joins
    for (int j = c; j < cols; ++j)
      s += (Fp8 ? e4m3_to_f32(w[j]) : static_cast<float>(static_cast<int8_t>(w[j]))) * x[t * ldx + j];
    y[t * ldy] = scale * s;
  }
}

template <int NT, bool Fp8>
void row_scalar(const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  for (int t = 0; t < NT; ++t) {
    float s = 0.f;
    for (int c = 0; c < cols; ++c)
      s += (Fp8 ? e4m3_to_f32(w[c]) : static_cast<float>(static_cast<int8_t>(w[c]))) * x[t * ldx + c];
    y[t * ldy] = scale * s;
  }
}

template <int NT, bool Fp8>
void row(Isa isa, const uint8_t* w, int cols, const float* x, int ldx, float scale, float* y, int ldy) {
  // The f16 route yields E4M3 values times 2^-8: the scale takes the 256 back.
  if (isa == Isa::Avx512) row_avx512<NT, Fp8>(w, cols, x, ldx, Fp8 ? scale * 256.f : scale, y, ldy);
  else if (isa == Isa::Avx2) row_avx2<NT, Fp8>(w, cols, x, ldx, scale, y, ldy);
  else row_scalar<NT, Fp8>(w, cols, x, ldx, scale, y, ldy);
}

template <bool Fp8>
void linear_codes(const uint8_t* w, const float* scales, int rows, int cols, const float* x, int n, float* y,
                  int threads, Isa vec) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; ++r) {
    const uint8_t* wr = w + static_cast<uint64_t>(r) * cols;
    const float s = scales[r];
    int t0 = 0;
    for (; t0 + kTile <= n; t0 += kTile)
      row<kTile, Fp8>(vec, wr, cols, x + static_cast<uint64_t>(t0) * cols, cols, s,
                      y + static_cast<uint64_t>(t0) * rows + r, rows);
    const float* xt = x + static_cast<uint64_t>(t0) * cols;
    float* yt = y + static_cast<uint64_t>(t0) * rows + r;
    switch (n - t0) {
      case 3: row<3, Fp8>(vec, wr, cols, xt, cols, s, yt, rows); break;
      case 2: row<2, Fp8>(vec, wr, cols, xt, cols, s, yt, rows); break;
      case 1: row<1, Fp8>(vec, wr, cols, xt, cols, s, yt, rows); break;
      default: break;
    }
  }
}

}  // namespace

void linear_quant(const uint8_t* w, const float* scales, bool fp8, int rows, int cols, const float* x, int n,
                  float* y, int threads, Isa isa) {
  const Isa vec = vector_isa(isa);
  if (fp8) linear_codes<true>(w, scales, rows, cols, x, n, y, threads, vec);
  else linear_codes<false>(w, scales, rows, cols, x, n, y, threads, vec);
}

void linear_q4(const uint8_t* codes, const uint16_t* scales, int rows, int cols, const float* x, int n, float* y,
               int threads, Isa isa) {
  // The expert kernels' Q4 matvec (kernels_*.cpp) over contiguous row blocks, one per thread: the same
  // codes and scales layout as a vault's Q4_G32 plane, so one kernel serves experts and backbone alike.
  const MatvecFn matvec = kernels_for(isa).q4;
  const int nb = (cols + 31) / 32;
  const int64_t row_bytes = static_cast<int64_t>(nb) * 16;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int per = ((rows + nt - 1) / nt + 15) / 16 * 16;  // whole groups of 16 rows
    const int r0 = std::min(rows, t * per), r1 = std::min(rows, r0 + per);
    if (r1 > r0)
      matvec({codes + r0 * row_bytes, scales + static_cast<int64_t>(r0) * nb, ScaleDtype::F16, r1 - r0, cols, x, cols,
              n, y + r0, rows});
  }
}

}  // namespace mosaic
