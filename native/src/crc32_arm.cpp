// CRC-32 with the ARMv8 CRC32 instructions (CRC32X: the same reflected polynomial, 0xEDB88320, as the
// tables): crc32.cpp's bulk on AArch64, eight bytes an instruction, where the CPU has them.
#include <arm_acle.h>

#include <cstring>

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#include "crc32_accelerated.h"

#if defined(__clang__)
#define MOSAIC_CRC __attribute__((target("crc")))
#else
#define MOSAIC_CRC __attribute__((target("+crc")))
#endif

namespace mosaic::detail {
namespace {

bool has_crc() {
#if defined(__linux__)
  return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0;
#elif defined(__APPLE__)
  int value = 0;
  size_t size = sizeof value;
  return sysctlbyname("hw.optional.armv8_crc32", &value, &size, nullptr, 0) == 0 && value != 0;
#else
  return false;
#endif
}

const bool kCrc = has_crc();

MOSAIC_CRC uint32_t crc32_words(uint32_t c, const uint8_t* p, size_t words) {
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);
    c = __crc32d(c, w);
  }
  return c;
}

}  // namespace

size_t crc32_accelerated(uint32_t& c, const uint8_t* p, size_t n) {
  if (!kCrc) return 0;
  c = crc32_words(c, p, n / 8);
  return n / 8 * 8;
}

}  // namespace mosaic::detail
