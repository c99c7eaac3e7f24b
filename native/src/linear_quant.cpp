// Y[n, rows] = X[n, cols] @ W.T for a backbone matrix quantised at load: int8 or FP8 (E4M3) codes with
// one float32 scale per output row. Activations stay float32 and every code widens to float exactly, so
// the only error is the weights' quantisation; half the bytes of bf16, for a kernel that is memory-bound.
// The rows' inner loops are per ISA (backbone_rows.h; the scalar reference in linear_bf16.cpp).
#include <omp.h>

#include <algorithm>

#include "backbone_rows.h"
#include "mosaic/kernels.h"

namespace mosaic {

void linear_quant(const uint8_t* w, const float* scales, bool fp8, int rows, int cols, const float* x, int n,
                  float* y, int threads, Isa isa) {
  const detail::BackboneRows rows_of = detail::backbone_rows(vector_isa(isa));
  const detail::CodeRowFn row = fp8 ? rows_of.fp8 : rows_of.int8;
  detail::for_row_tiles(rows, cols, n, threads, 1, [&](int r, int, int t0, int nt) {
    row(w + static_cast<uint64_t>(r) * cols, cols, x + static_cast<uint64_t>(t0) * cols, cols, nt, scales[r],
        y + static_cast<uint64_t>(t0) * rows + r, rows);
  });
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
