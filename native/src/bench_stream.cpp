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

static double sum_scalar(const uint8_t* p, uint64_t n) {
  uint64_t s = 0;
  for (uint64_t i = 0; i + 8 <= n; i += 8) s += *reinterpret_cast<const uint64_t*>(p + i);
  return static_cast<double>(s);
}

double stream_read(const uint8_t* data, uint64_t n, int threads) {
  const bool wide = best_isa() == Isa::Avx512;
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const uint64_t chunk = n / nt / 128 * 128, begin = t * chunk;
    total += wide ? sum_avx512(data + begin, chunk) : sum_scalar(data + begin, chunk);
  }
  return total;
}

}  // namespace mosaic
