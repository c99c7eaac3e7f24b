// Stands in for OpenMP's header where the compiler has none (Apple clang without libomp): the parallel
// regions' pragmas are ignored and every region runs on the calling thread, as thread 0 of 1.
#pragma once

inline int omp_get_thread_num() { return 0; }
inline int omp_get_num_threads() { return 1; }
inline int omp_get_max_threads() { return 1; }
