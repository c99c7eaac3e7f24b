// Run-time ISA choice and the MoE driver: whole experts per thread, combined in task order.
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "mosaic/kernels.h"

namespace mosaic {

Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
  return Isa::Scalar;
}

bool has_vnni() {
  __builtin_cpu_init();
  return best_isa() == Isa::Avx512 && __builtin_cpu_supports("avx512vnni");
}

bool isa_available(Isa isa) {
  return isa == Isa::Avx512Vnni ? has_vnni() : static_cast<int>(isa) <= static_cast<int>(best_isa());
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return "avx512-vnni (int8 activations)";
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

IsaKernels kernels_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return avx512_vnni_kernels();
    case Isa::Avx512: return avx512_kernels();
    case Isa::Avx2: return avx2_kernels();
    default: return scalar_kernels();
  }
}

// Scratch: [task outputs: total_rows x H] then per thread [x rows: max_n x H][gate: max_n x I][up: max_n x I].
uint64_t moe_scratch_floats(const RecordLayout& layout, int total_rows, int max_rows_per_task, int threads) {
  const uint64_t h = layout.planes[4].rows, i = layout.planes[0].rows;  // down codes rows = H; gate rows = I
  return static_cast<uint64_t>(total_rows) * h + static_cast<uint64_t>(threads) * max_rows_per_task * (h + 2 * i);
}

namespace {

// Per-call bookkeeping kept across calls, so a decode step allocates nothing once warm.
struct DriverState {
  std::unique_ptr<std::atomic<uint8_t>[]> claimed;
  std::vector<uint64_t> first_row;
  int capacity = 0;
  void reserve(int n) {
    if (n > capacity) {
      claimed.reset(new std::atomic<uint8_t>[n]);
      capacity = n;
    }
    first_row.resize(n);
  }
};

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

int moe_experts(const RecordLayout& layout, QuantType quant, const float* x, int hidden, const ExpertTask* tasks,
                int n_tasks, float* y, float* scratch, Isa isa, int threads, const Arrivals* arrivals,
                MoeTiming* timing) {
  const Clock::time_point start = Clock::now();
  const IsaKernels k = kernels_for(isa);
  const MatvecFn matvec = quant == QuantType::Q4_G32 ? k.q4 : k.fp8;
  const Plane *gc = &layout.planes[0], *gs = &layout.planes[1], *uc = &layout.planes[2], *us = &layout.planes[3];
  const Plane *dc = &layout.planes[4], *ds = &layout.planes[5];
  const int inter = static_cast<int>(gc->rows);
  const ScaleDtype sdt = quant == QuantType::Q4_G32 ? ScaleDtype::F16 : layout.scale_dtype;

  thread_local DriverState st;
  st.reserve(n_tasks);
  int max_n = 0;
  uint64_t total = 0;
  for (int t = 0; t < n_tasks; ++t) {
    st.first_row[t] = total;
    st.claimed[t].store(0, std::memory_order_relaxed);
    max_n = tasks[t].n > max_n ? tasks[t].n : max_n;
    total += tasks[t].n;
  }
  float* outs = scratch;
  float* per_thread = scratch + total * hidden;
  const uint64_t thread_floats = static_cast<uint64_t>(max_n) * (hidden + 2 * inter);
  std::atomic<int> failed{-1};
  std::atomic<int64_t> wait_ns{0};
  DriverState* shared = &st;

  auto ready = [&](int t) {
    return tasks[t].slot < 0 || arrivals == nullptr ? RecordStatus::Ready : arrivals->status(tasks[t].slot);
  };

#pragma omp parallel num_threads(threads)
  {
    float* xs = per_thread + omp_get_thread_num() * thread_floats;
    float* g = xs + static_cast<uint64_t>(max_n) * hidden;
    float* u = g + static_cast<uint64_t>(max_n) * inter;
    for (;;) {
      // Take the first unclaimed task whose record is here; sleep on the ring if none is yet.
      const uint64_t epoch = arrivals ? arrivals->epoch() : 0;
      int pick = -1;
      bool left = false;
      for (int t = 0; t < n_tasks && pick < 0; ++t) {
        if (shared->claimed[t].load(std::memory_order_relaxed)) continue;
        const RecordStatus rs = ready(t);
        if (rs == RecordStatus::Pending) {
          left = true;
          continue;
        }
        if (shared->claimed[t].exchange(1)) continue;  // another thread got there first
        if (rs == RecordStatus::Failed) {
          int none = -1;
          failed.compare_exchange_strong(none, t);
          continue;
        }
        pick = t;
      }
      if (pick < 0) {
        if (!left) break;
        const Clock::time_point w = Clock::now();
        arrivals->wait_past(epoch);
        wait_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - w).count());
        continue;
      }
      if (failed.load(std::memory_order_relaxed) >= 0) continue;  // the result is void: only drain
      const ExpertTask& task = tasks[pick];
      for (int i = 0; i < task.n; ++i)
        std::memcpy(xs + static_cast<uint64_t>(i) * hidden, x + static_cast<uint64_t>(task.tokens[i]) * hidden,
                    sizeof(float) * hidden);
      const uint8_t* rec = task.record;
      matvec({rec + gc->offset, rec + gs->offset, sdt, inter, hidden, xs, hidden, task.n, g, inter});
      matvec({rec + uc->offset, rec + us->offset, sdt, inter, hidden, xs, hidden, task.n, u, inter});
      for (uint64_t i = 0; i < static_cast<uint64_t>(task.n) * inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      matvec({rec + dc->offset, rec + ds->offset, sdt, hidden, inter, g, inter, task.n,
              outs + shared->first_row[pick] * hidden, hidden});
    }
  }
  if (timing) {
    timing->wait_s = static_cast<double>(wait_ns.load()) * 1e-9 / (threads > 0 ? threads : 1);
    timing->total_s = seconds(Clock::now() - start);
  }
  if (failed.load() >= 0) return failed.load();
  // Combine in task order: the same sums in the same order whatever the threads did.
  uint64_t row = 0;
  for (int t = 0; t < n_tasks; ++t)
    for (int i = 0; i < tasks[t].n; ++i, ++row) {
      float* dst = y + static_cast<uint64_t>(tasks[t].tokens[i]) * hidden;
      const float* src = outs + row * hidden;
      const float w = tasks[t].weights[i];
      for (int c = 0; c < hidden; ++c) dst[c] += w * src[c];
    }
  if (timing) timing->total_s = seconds(Clock::now() - start);
  return -1;
}

}  // namespace mosaic
