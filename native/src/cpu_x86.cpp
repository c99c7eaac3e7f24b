// x86-64: ISA detection through the compiler's cpuid wrappers (and, for AMX, the kernel's permission), the
// pause hint, and AVX streaming loads.
#include <immintrin.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu.h"

namespace mosaic::cpu {

Isa hardware_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::Avx2;
  return Isa::Scalar;
}

const Isa* int8_isas(int* count) {
  static const Isa isas[] = {Isa::Amx, Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2Int8};
  *count = 4;
  return isas;
}

namespace {

// AMX tiles with VNNI beside them (kernels_amx.cpp needs both). Linux hands a process the tile registers'
// state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), for all its threads; a
// kernel without AMX support refuses. Elsewhere (no AMX CPU runs macOS) there is no AMX path.
bool amx_usable() {
#if defined(__linux__)
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                         __builtin_cpu_supports("avx512vnni") &&
                         syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool int8_runs(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::Amx: return amx_usable();
    case Isa::Avx512Vnni: return __builtin_cpu_supports("avx512vnni");
    case Isa::AvxVnni: return __builtin_cpu_supports("avxvnni");
    case Isa::Avx2Int8: return true;  // AVX2's own instructions
    default: return false;
  }
}

const Isa* vector_isas(int* count) {
  static const Isa isas[] = {Isa::Scalar, Isa::Avx2, Isa::Avx512};
  *count = 3;
  return isas;
}

void relax() { _mm_pause(); }

namespace {

__attribute__((target("avx512f"))) double sum_avx512(const uint8_t* p, uint64_t n) {
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  for (uint64_t i = 0; i + 128 <= n; i += 128) {
    acc0 = _mm512_add_epi64(acc0, _mm512_loadu_si512(p + i));
    acc1 = _mm512_add_epi64(acc1, _mm512_loadu_si512(p + i + 64));
  }
  return static_cast<double>(_mm512_reduce_add_epi64(_mm512_add_epi64(acc0, acc1)));
}

__attribute__((target("avx2"))) double sum_avx2(const uint8_t* p, uint64_t n) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  for (uint64_t i = 0; i + 64 <= n; i += 64) {
    acc0 = _mm256_add_epi64(acc0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    acc1 = _mm256_add_epi64(acc1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  return static_cast<double>(lanes[0] + lanes[1] + lanes[2] + lanes[3]);
}

double sum_scalar(const uint8_t* p, uint64_t n) {
  uint64_t s = 0;
  for (uint64_t i = 0; i + 8 <= n; i += 8) s += *reinterpret_cast<const uint64_t*>(p + i);
  return static_cast<double>(s);
}

}  // namespace

double stream_sum(const uint8_t* p, uint64_t n) {
  // The hardware's widest loads, whatever MOSAIC_ISA forces: the roofline is the memory's.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return sum_avx512(p, n);
  if (__builtin_cpu_supports("avx2")) return sum_avx2(p, n);
  return sum_scalar(p, n);
}

}  // namespace mosaic::cpu
