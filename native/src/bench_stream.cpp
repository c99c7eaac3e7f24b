// The memory-read roofline the kernel benchmarks compare against: a streaming sum of a large buffer,
// split over threads like the kernels split experts.
#include <omp.h>

#include <cstdint>

#include "cpu.h"
#include "mosaic/kernels.h"

namespace mosaic {

double stream_read(const uint8_t* data, uint64_t n, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const uint64_t chunk = n / nt / 128 * 128, begin = t * chunk;
    total += cpu::stream_sum(data + begin, chunk);
  }
  return total;
}

}  // namespace mosaic
