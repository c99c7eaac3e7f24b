// The target of the functions compiled for AVX2 (internal to native/src).
#pragma once

#define MOSAIC_AVX2 __attribute__((target("avx2,fma,f16c")))
