// AArch64: NEON is part of the base ISA; the int8 dot product (SDOT, FEAT_DotProd) and matrix multiply
// (SMMLA, FEAT_I8MM) are read from the kernel's hardware capabilities on Linux and from sysctl on macOS.
#include <arm_neon.h>

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#include "cpu.h"

namespace mosaic::cpu {

namespace {

#if defined(__APPLE__)
bool sysctl_flag(const char* name) {
  int value = 0;
  size_t size = sizeof value;
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
#endif

bool has_dotprod() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
  return sysctl_flag("hw.optional.arm.FEAT_DotProd");
#else
  return false;
#endif
}

bool has_i8mm() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#elif defined(__APPLE__)
  return sysctl_flag("hw.optional.arm.FEAT_I8MM");
#else
  return false;
#endif
}

}  // namespace

Isa hardware_isa() { return Isa::Neon; }


const Isa* vector_isas(int* count) {
  static const Isa isas[] = {Isa::Scalar, Isa::Neon};
  *count = 2;
  return isas;
}

const Isa* int8_isas(int* count) {
  static const Isa isas[] = {Isa::NeonI8mm, Isa::NeonDot};
  *count = 2;
  return isas;
}

bool int8_runs(Isa isa) {
  if (isa == Isa::NeonI8mm) return has_dotprod() && has_i8mm();  // its decode steps run SDOT
  return isa == Isa::NeonDot && has_dotprod();
}

void relax() { __asm__ __volatile__("yield"); }

double stream_sum(const uint8_t* p, uint64_t n) {
  uint64x2_t acc0 = vdupq_n_u64(0), acc1 = vdupq_n_u64(0);
  for (uint64_t i = 0; i + 32 <= n; i += 32) {
    acc0 = vaddq_u64(acc0, vreinterpretq_u64_u8(vld1q_u8(p + i)));
    acc1 = vaddq_u64(acc1, vreinterpretq_u64_u8(vld1q_u8(p + i + 16)));
  }
  return static_cast<double>(vaddvq_u64(vaddq_u64(acc0, acc1)));
}

}  // namespace mosaic::cpu
