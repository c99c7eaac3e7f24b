// What differs between CPU architectures outside the kernels: the vector ISA the hardware has, a spin-wait
// hint, and the memory roofline's widest loads. One definition per architecture (cpu_x86.cpp, cpu_arm.cpp);
// internal to native/src.
#pragma once

#include <cstdint>

#include "mosaic/kernels.h"

namespace mosaic::cpu {

// The widest float-activation ISA this CPU runs (Avx512, Avx2, Neon, or Scalar).
Isa hardware_isa();
// Every float ISA this architecture has a path for, by rank (Scalar first).
const Isa* vector_isas(int* count);
// Every int8-activation ISA this architecture has a path for, the fastest first.
const Isa* int8_isas(int* count);
// Whether the hardware has an int8-activation ISA's instructions (its float ISA's aside).
bool int8_runs(Isa isa);
// A spin-wait's pause between two polls of a flag another thread sets.
void relax();
// Sums n bytes as 64-bit lanes with the hardware's widest loads (stream_read, the benchmarks' roofline).
double stream_sum(const uint8_t* p, uint64_t n);

}  // namespace mosaic::cpu
