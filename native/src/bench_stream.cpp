// The memory-read roofline the kernel benchmarks compare against: a streaming sum of a large buffer,
// split over threads like the kernels split experts.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>

#include "mosaic/kernels.h"

namespace mosaic {

__attribute__((target("avx512f"))) static double sum_avx512(const uint8_t* p, uint64_t n) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  uint64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    acc0 = _mm512_add_epi64(acc0, _mm512_loadu_si512(p + i));
    acc1 = _mm512_add_epi64(acc1, _mm512_loadu_si512(p + i + 64));
  }
  return static_cast<double>(_mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1)));
}

__attribute__((target("avx2"))) static double sum_avx2(const uint8_t* p, uint64_t n) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm256_add_epi64(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    acc1 = _mm256_add_epi64(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  return static_cast<double>(lanes[0] + lanes[1] + lanes[2] + lanes[3]);
}

static double sum_scalar(const uint8_t* p, uint64_t n) {
  uint64_t s = 0;
  for (uint64_t i = 0; i + 8 <= n; i += 8) s += *reinterpret_cast<const uint64_t*>(p + i);
  return static_cast<double>(s);
}

double stream_read(const uint8_t* data, uint64_t n, int threads) {
  // The hardware's widest loads, whatever MOSAIC_ISA forces: the roofline is the memory's.
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const uint64_t chunk = n / nt / 128 * 128, begin = t * chunk;
    total += avx512 ? sum_avx512(data + begin, chunk)
             : avx2 ? sum_avx2(data + begin, chunk)
                    : sum_scalar(data + begin, chunk);
  }
  return total;
}

}  // namespace mosaic
