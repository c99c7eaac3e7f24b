// What the decode-attention driver (attention.cpp) and its per-ISA tasks share: the chunking, the online
// softmax's slack, the prefetcher, a task's partial result, and the tasks' entry points. Internal to native/src.
#pragma once

#include <cstdint>

namespace mosaic {
namespace attention {

constexpr int kChunk = 512;  // keys per task: 2 x 512 KB of f32 K and V at head_dim 256
constexpr int kTile = 16;    // keys whose scores are exponentiated together (one zmm)
constexpr int kMaxDim = 512;  // the widest head the integer task takes: its int32 sums of 16-bit x 8-bit products
constexpr int kMaxRep = 64;   // the most query heads a task takes (the driver splits larger groups)

// A task with an online softmax (the AVX-512, AVX2 and NEON tasks) moves its reference max only when a score
// exceeds it by more than this, so most tiles need no max reduction and no rescaling of the outputs;
// probabilities stay below e^8 (about 3000) before the final normalisation.
constexpr float kSlack = 8.f;

// The score exponential of the online-softmax tasks (exp_scores, exp8, exp4), one set of constants for every
// width: x = n ln2 + r, |r| <= ln2/2, with ln2 split in two for accuracy; e^r by its Taylor polynomial of
// degree 6 (Horner, highest term first), about 2 ulp; e^x taken as 0 below kExpFloor (a masked key's -inf).
constexpr float kExpFloor = -87.f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpTerms[7] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

struct Partial {  // one task's state for one query head: its probabilities' sum, relative to e^ref
  float ref, sum;
};

// The next tile's key and value lines, prefetched towards L1 a few at a time from inside the arithmetic (step()
// once an inner iteration), so memory streams behind the compute, and the lines of the tile after it towards L2
// alongside. A burst of prefetches would fill the core's dozen line-fill buffers and stall it, and with no
// prefetch the stream idles whenever the loop works from L1. With the L1 stream alone, a cache the layer's
// weights had just flushed arrived at about 14 GB/s; the L2 stream a tile further ahead keeps more lines in
// flight without holding line-fill buffers (benchmarks/RESULTS.md, "Decode attention from memory"). Prefetching
// past the end of the cache is harmless: prefetches never fault.
struct Prefetcher {
  const char* k;
  const char* v;
  int lines;     // 64-byte lines in one tile of K (the same of V)
  int per_step;  // lines a step
  int done = 0;
  inline void step() {
    for (int i = 0; i < per_step && done < 2 * lines; ++i, ++done) {
      const char* p = done < lines ? k + 64 * static_cast<int64_t>(done) : v + 64 * static_cast<int64_t>(done - lines);
      __builtin_prefetch(p, 0, 3);  // prefetcht0
      __builtin_prefetch(p + 64 * static_cast<int64_t>(lines), 0, 2);  // the tile after: prefetcht1
    }
  }
};

struct RowScales {  // an int8 cache's per-row scales for one KV head (position j at k[j], v[j]); else null
  const float* k = nullptr;
  const float* v = nullptr;
};

// One task: rep query heads (at most kMaxRep; q, rep x d, already times the attention scale, in the task's
// element order) over keys [k0, k1) of one KV head (k and v: that head's rows, d elements each; int8 rows
// times rs). Leaves unnormalised outputs in o (rep x d, the same order) and each head's max and sum in part.
// AVX-512 (attention_avx512.cpp): head_dim a multiple of 16 (of 32 for bf16 and int8); bf16 rows in the
// evens-then-odds order of each block of 32 (split_order).
void task_avx512(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part);
void task_avx512(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part);
void task_avx512(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
                 float* o, Partial* part);
// AVX2 (attention_avx2.cpp) and NEON (attention_neon.cpp): head_dim a multiple of 8, elements in place.
void task_avx2(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);
void task_avx2(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);
void task_avx2(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);
void task_neon(const float* q, int rep, int d, const float* k, const float* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);
void task_neon(const float* q, int rep, int d, const uint16_t* k, const uint16_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);
void task_neon(const float* q, int rep, int d, const int8_t* k, const int8_t* v, RowScales rs, int k0, int k1,
               float* o, Partial* part);

// One int8 task through AVX-512 VNNI integer dot products (attention_i8.cpp): rep query heads as int16
// codes q16 (rep x d) with a scale each (qscale, the attention scale folded in), over keys [k0, k1) of
// one KV head. Leaves unnormalised outputs in o (rep x d, in i8_order within each block of 32) and
// max/sum in part. head_dim a multiple of 32, at most kMaxDim; rep at most kMaxRep.
void task_i8_vnni(const int16_t* q16, const float* qscale, int rep, int d, const int8_t* k, const int8_t* v,
                  RowScales rs, int k0, int k1, float* o, Partial* part);

// Where task_i8_vnni keeps element i of an output row: each block of 32 holds elements 0-7, 16-23, then
// 8-15, 24-31 (the order in which byte unpacks pair two value rows).
inline int i8_order(int i) {
  const int group = (i >> 3) & 3;
  return group == 1 ? i + 8 : group == 2 ? i - 8 : i;
}

}  // namespace attention
}  // namespace mosaic
