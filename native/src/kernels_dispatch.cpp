// Run-time ISA choice and the MoE drivers: whole experts per thread (or, for a decode step, their
// projections as work items), combined in task order.
#include <omp.h>

#include <algorithm>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu.h"
#include "mosaic/kernels.h"

namespace mosaic {

namespace {

// A float ISA's rank among this architecture's (Scalar 0), or -1 when it is not one of them.
int rank_of(Isa isa) {
  int count = 0;
  const Isa* isas = cpu::vector_isas(&count);
  for (int i = 0; i < count; ++i)
    if (isas[i] == isa) return i;
  return -1;
}

bool is_int8(Isa isa) { return vector_isa(isa) != isa; }

// The ISAs MOSAIC_ISA may name on this architecture: the float ones, then the int8-activation ones.
std::vector<Isa> nameable_isas() {
  int n_float = 0, n_int8 = 0;
  const Isa* floats = cpu::vector_isas(&n_float);
  const Isa* int8s = cpu::int8_isas(&n_int8);
  std::vector<Isa> out(floats, floats + n_float);
  out.insert(out.end(), int8s, int8s + n_int8);
  return out;
}

// MOSAIC_ISA's choice, or nothing when it is unset or not one of nameable_isas() (reported once on stderr).
std::optional<Isa> forced() {
  static const std::optional<Isa> choice = []() -> std::optional<Isa> {
    const char* env = std::getenv("MOSAIC_ISA");
    if (env == nullptr || *env == '\0') return std::nullopt;
    const std::vector<Isa> isas = nameable_isas();
    for (Isa isa : isas)
      if (std::strcmp(env, isa_name(isa)) == 0) return isa;
    std::string names;
    for (Isa isa : isas) names += std::string(names.empty() ? "" : ", ") + isa_name(isa);
    std::fprintf(stderr, "mosaic: MOSAIC_ISA=%s is not one of %s; ignored\n", env, names.c_str());
    return std::nullopt;
  }();
  return choice;
}

// The fastest int8-activation ISA the hardware runs whose float ISA is at most `vector`, or Scalar.
Isa int8_isa_under(Isa vector) {
  int count = 0;
  const Isa* isas = cpu::int8_isas(&count);
  for (int i = 0; i < count; ++i)
    if (cpu::int8_runs(isas[i]) && rank_of(vector_isa(isas[i])) <= rank_of(vector)) return isas[i];
  return Isa::Scalar;
}

}  // namespace

Isa best_isa() {
  static const Isa isa = [] {
    const Isa hw = cpu::hardware_isa();
    const Isa cap = forced() ? vector_isa(*forced()) : hw;
    return rank_of(cap) < rank_of(hw) ? cap : hw;
  }();
  return isa;
}

Isa int8_isa() {
  static const Isa isa = [] {
    const std::optional<Isa> f = forced();
    if (f && is_int8(*f)) {
      if (isa_available(*f)) return *f;
      std::fprintf(stderr, "mosaic: MOSAIC_ISA=%s: this CPU lacks it; taking %s\n", isa_name(*f),
                   isa_name(int8_isa_under(best_isa())));
    }
    return int8_isa_under(best_isa());
  }();
  return isa;
}

bool isa_available(Isa isa) {
  const int rank = rank_of(vector_isa(isa));
  if (rank < 0 || rank > rank_of(best_isa())) return false;  // another architecture's, or above the cap
  return !is_int8(isa) || cpu::int8_runs(isa);
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512Vnni: return "avx512-vnni";
    case Isa::Avx2Int8: return "avx2-int8";
    case Isa::AvxVnni: return "avx-vnni";
    case Isa::Amx: return "amx";
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Neon: return "neon";
    case Isa::NeonDot: return "neon-dot";
    case Isa::NeonI8mm: return "neon-i8mm";
    default: return "scalar";
  }
}

IsaKernels kernels_for(Isa isa) {
  switch (isa) {
#if defined(MOSAIC_X86)
    case Isa::Avx512Vnni: return avx512_vnni_kernels();
    case Isa::Avx2Int8: return avx2_int8_kernels();
    case Isa::AvxVnni: return avx_vnni_kernels();
    case Isa::Amx: return amx_kernels();
    case Isa::Avx512: return avx512_kernels();
    case Isa::Avx2: return avx2_kernels();
#elif defined(MOSAIC_ARM)
    case Isa::Neon: return neon_kernels();
    case Isa::NeonDot: return neon_dot_kernels();
    case Isa::NeonI8mm: return neon_i8mm_kernels();
#endif
    default: return scalar_kernels();
  }
}

ExpertFormat::ExpertFormat(uint32_t quant, uint32_t scale_dtype, uint32_t hidden, uint32_t intermediate, bool bias,
                           int activation, float alpha, float limit) {
  if (quant < 1 || quant > 3 || scale_dtype < 1 || scale_dtype > 4 || hidden == 0 || intermediate == 0)
    throw std::invalid_argument("ExpertFormat: unknown quant type or scale dtype, or an empty geometry");
  if (activation < 0 || activation > 1) throw std::invalid_argument("ExpertFormat: unknown activation");
  layout = record_layout(QuantType(quant), ScaleDtype(scale_dtype), hidden, intermediate, bias);
  act = {ExpertActivation::Kind(activation), alpha, limit};
}

// Scratch: [task outputs: total_rows x H] then per thread [x rows: max_n x H][gate: max_n x I][up: max_n x I];
// a decode-shaped call (one row a task) may instead take [gate, up: 2 x I] per task (moe_decode_staged).
uint64_t moe_scratch_floats(const RecordLayout& layout, int total_rows, int max_rows_per_task, int threads) {
  const uint64_t h = layout.planes[4].rows, i = layout.planes[0].rows;  // down codes rows = H; gate rows = I
  const uint64_t per_thread = static_cast<uint64_t>(threads) * max_rows_per_task * (h + 2 * i);
  const uint64_t staged = max_rows_per_task == 1 ? static_cast<uint64_t>(total_rows) * 2 * i : 0;
  return static_cast<uint64_t>(total_rows) * h + std::max(per_thread, staged);
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

// rows [r0, r1) of each of n output rows (`width` floats apart) += the record's bias plane.
void add_bias(const uint8_t* record, const Plane& bias, float* out, int n, int width, int r0 = 0, int r1 = -1) {
  const auto* b = reinterpret_cast<const float*>(record + bias.offset);  // planes sit on 64-byte boundaries
  if (r1 < 0) r1 = width;
  for (int t = 0; t < n; ++t) {
    float* o = out + static_cast<uint64_t>(t) * width;
    for (int r = r0; r < r1; ++r) o[r] += b[r];
  }
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

// y += the tasks' experts in task order, for a decode-shaped call: every task one row, every record here.
// Each expert is four work items, its gate and its up projection and two halves of its down projection's
// rows, so the threads share the last expert instead of one of them running it alone: whole experts left
// the threads idle 4 % of the MoE time, waiting on each other's last one. Every row is computed as in
// moe_experts, so the sums are bit for bit its own.
void moe_decode_staged(const RecordLayout& layout, const ExpertActivation& act, MatvecFn matvec, const float* x,
                       int hidden, const ExpertTask* tasks, int n_tasks, float* y, float* scratch, int threads) {
  const Plane *gc = &layout.planes[0], *gs = &layout.planes[1], *uc = &layout.planes[2], *us = &layout.planes[3];
  const Plane *dc = &layout.planes[4], *ds = &layout.planes[5];
  const ScaleDtype sdt = layout.scale_dtype;
  const int inter = static_cast<int>(gc->rows);
  // The down projection's rows split where a scale row starts (FP8: a 128-row block); the second half is
  // empty when the first takes them all.
  const int rows_per_scale_row = layout.quant == QuantType::FP8_B128 ? kFp8 : 1;
  const int align = std::max(16, rows_per_scale_row);
  const int half = std::min(hidden, (hidden / 2 + align - 1) / align * align);
  const uint64_t code_row_bytes = dc->nbytes / dc->rows, scale_row_bytes = ds->nbytes / ds->rows;
  float* outs = scratch;                                   // [n_tasks][hidden]
  float* gu = scratch + static_cast<uint64_t>(n_tasks) * hidden;  // [n_tasks][gate: inter, up: inter]
  thread_local std::vector<std::atomic<uint8_t>> claimed;  // per item
  thread_local std::vector<std::atomic<uint8_t>> halves;   // per task: gate and up done (2: activation ready)
  const int items = 4 * n_tasks;
  if (static_cast<int>(claimed.size()) < items) {
    claimed = std::vector<std::atomic<uint8_t>>(items);
    halves = std::vector<std::atomic<uint8_t>>(n_tasks);
  }
  for (int i = 0; i < items; ++i) claimed[i].store(0, std::memory_order_relaxed);
  for (int t = 0; t < n_tasks; ++t) halves[t].store(0, std::memory_order_relaxed);
  std::atomic<int> left{items};
  auto* claim = claimed.data();
  auto* ready = halves.data();
#pragma omp parallel num_threads(threads)
  while (left.load(std::memory_order_acquire) > 0) {
    // The first unclaimed item it can run: a down half once its expert's activation is ready, else a gate
    // or up projection (downs first, so the activations in flight stay few).
    int pick = -1;
    for (int i = 0; i < items && pick < 0; ++i) {
      const int t = i % n_tasks, stage = 3 - i / n_tasks;  // items [down_hi.., down_lo.., up.., gate..]
      if (claim[t * 4 + stage].load(std::memory_order_relaxed)) continue;
      if (stage >= 2 && ready[t].load(std::memory_order_acquire) < 3) continue;
      if (!claim[t * 4 + stage].exchange(1)) pick = t * 4 + stage;
    }
    if (pick < 0) {
      cpu::relax();  // the other thread is finishing a gate or up this one's remaining downs need
      continue;
    }
    const int t = pick / 4, stage = pick % 4;
    const uint8_t* rec = tasks[t].record;
    const float* xt = x + static_cast<uint64_t>(tasks[t].tokens[0]) * hidden;
    float* g = gu + static_cast<uint64_t>(t) * 2 * inter;
    float* u = g + inter;
    if (stage < 2) {
      if (stage == 0) {
        matvec({rec + gc->offset, rec + gs->offset, sdt, inter, hidden, xt, hidden, 1, g, inter});
        if (layout.bias) add_bias(rec, layout.planes[6], g, 1, inter);
      } else {
        matvec({rec + uc->offset, rec + us->offset, sdt, inter, hidden, xt, hidden, 1, u, inter});
        if (layout.bias) add_bias(rec, layout.planes[7], u, 1, inter);
      }
      if (ready[t].fetch_add(1, std::memory_order_acq_rel) == 1) {  // the second of the two: the activation
        apply_activation(act, g, u, inter);
        ready[t].store(3, std::memory_order_release);
      }
    } else {
      const int r0 = stage == 2 ? 0 : half, r1 = stage == 2 ? half : hidden;
      float* out = outs + static_cast<uint64_t>(t) * hidden;
      if (r1 > r0) {
        matvec({rec + dc->offset + r0 * code_row_bytes, rec + ds->offset + (r0 / rows_per_scale_row) * scale_row_bytes,
                sdt, r1 - r0, inter, g, inter, 1, out + r0, hidden});
        if (layout.bias) add_bias(rec, layout.planes[8], out, 1, hidden, r0, r1);
      }
    }
    left.fetch_sub(1, std::memory_order_acq_rel);
  }
  for (int t = 0; t < n_tasks; ++t) {  // in task order: the same sums whatever the threads did
    float* dst = y + static_cast<uint64_t>(tasks[t].tokens[0]) * hidden;
    const float* src = outs + static_cast<uint64_t>(t) * hidden;
    const float w = tasks[t].weights[0];
    for (int c = 0; c < hidden; ++c) dst[c] += w * src[c];
  }
}

int moe_experts(const RecordLayout& layout, const ExpertActivation& act, const float* x, int hidden,
                const ExpertTask* tasks, int n_tasks, float* y, float* scratch, Isa isa, int threads,
                const Arrivals* arrivals, MoeTiming* timing) {
  const Clock::time_point start = Clock::now();
  const MatvecFn matvec = kernels_for(isa).of(layout.quant);
  const Plane *gc = &layout.planes[0], *gs = &layout.planes[1], *uc = &layout.planes[2], *us = &layout.planes[3];
  const Plane *dc = &layout.planes[4], *ds = &layout.planes[5];
  const int inter = static_cast<int>(gc->rows);
  const ScaleDtype sdt = layout.scale_dtype;
  auto ready = [&](int t) {
    return tasks[t].slot < 0 || arrivals == nullptr ? RecordStatus::Ready : arrivals->status(tasks[t].slot);
  };
  // Every task one row and every record already here: the staged driver. With reads still landing, whole
  // experts a thread are faster: sharing the last one to land kept both cores busy while the ring's reader
  // needed one to keep the disk fed (a 25 % replay 9-16 % slower, the disk busy a smaller share).
  bool one_row = true;
  for (int t = 0; t < n_tasks && one_row; ++t) one_row = tasks[t].n == 1 && ready(t) == RecordStatus::Ready;
  if (one_row) {
    moe_decode_staged(layout, act, matvec, x, hidden, tasks, n_tasks, y, scratch, threads);
    if (timing) timing->wait_s = 0.0, timing->total_s = seconds(Clock::now() - start);
    return -1;
  }

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
      float* out = outs + shared->first_row[pick] * hidden;
      matvec({rec + gc->offset, rec + gs->offset, sdt, inter, hidden, xs, hidden, task.n, g, inter});
      matvec({rec + uc->offset, rec + us->offset, sdt, inter, hidden, xs, hidden, task.n, u, inter});
      if (layout.bias) {
        add_bias(rec, layout.planes[6], g, task.n, inter);
        add_bias(rec, layout.planes[7], u, task.n, inter);
      }
      apply_activation(act, g, u, static_cast<uint64_t>(task.n) * inter);
      matvec({rec + dc->offset, rec + ds->offset, sdt, hidden, inter, g, inter, task.n, out, hidden});
      if (layout.bias) add_bias(rec, layout.planes[8], out, task.n, hidden);
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
