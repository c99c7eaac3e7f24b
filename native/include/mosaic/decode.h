// The native decode step: one token through every layer of any recipe (mosaic_runtime/models/recipe.py) in
// one call. Per layer: x += mixer(RMSNorm(x)) with an attention or a Gated DeltaNet mixer; h = RMSNorm(x);
// then the FFN: the router's top-k and the routed experts from the expert ring, a shared expert (optionally
// gated), or a dense MLP. The torch reference is mosaic_runtime/models/decoder.py.
#pragma once

#include <cstdint>

#include "mosaic/kernels.h"

namespace mosaic {

class ExpertRing;

// A backbone matrix [rows, cols] as the runtime holds it: bf16 bit patterns; int8 / E4M3 codes with a
// float32 scale per row (backbone.QuantizedMatrix); or Q4_G32 codes with an f16 scale per 32 (Q4Matrix).
struct BackboneMatrix {
  enum Kind : int { Bf16 = 0, Int8 = 1, Fp8 = 2, Q4 = 3 };
  const void* w = nullptr;
  const void* scales = nullptr;   // int8 / fp8: float32 per row; q4: f16 per 32 (bits as uint16)
  Kind kind = Bf16;
  int rows = 0, cols = 0;         // rows == 0: absent
};

// The element type of a decode step's KV cache (kv_cache.KVCache): float32, bf16 bit patterns, or int8
// codes with a float32 scale per (position, KV head) row.
enum class KvDtype : int { F32 = 0, Bf16 = 1, I8 = 2 };

enum class QkNorm : int { None = 0, Head = 1, Projection = 2 };
enum class Scoring : int { Softmax = 0, Sigmoid = 1 };
enum class TopkMethod : int { Greedy = 0, GroupLimited = 1, NoauxTc = 2 };

// Softmax attention over the KV cache (GQA / MQA / MHA).
struct AttentionMixer {
  int heads = 0, kv_heads = 0, head_dim = 0, rot_dim = 0;
  QkNorm qk_norm = QkNorm::None;
  bool output_gate = false;       // q rows per head: head_dim query values, then head_dim gate values
  int sliding_window = 0;         // 0: every earlier position; else the last sliding_window, this one included
  float clip_qkv = 0.f;           // 0: none; else q, k, v clamped to +-clip_qkv after their norms
  float scale = 1.f;              // softmax scale
  BackboneMatrix q, k, v, o;
  const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *o_bias = nullptr;  // null: none
  const float *q_norm = nullptr, *k_norm = nullptr;  // [head_dim] (Head) or [heads|kv_heads * head_dim] (Projection)
  const float* sinks = nullptr;   // [heads]: a logit each head's softmax adds to its denominator; null: none
  bool windowed = false;          // its keys and values are in the window ring (KvRuns::window), not the KV run
  int kv_layer = 0;               // this layer's row of the KV run (or of the window ring)
};

// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the KV cache holds one latent row a position,
// [kv_lora_rank normed values | rope_dim roped key], that is key and value of every head (kv_heads 1,
// head_dim latent_dim). kv_b_proj is absorbed: each head's query meets the latent through uk_t (its key rows,
// transposed) and its attended latent leaves through uv (its value rows).
struct LatentMixer {
  int heads = 0, q_lora_rank = 0, kv_lora_rank = 0, nope_dim = 0, rope_dim = 0, v_dim = 0;
  float eps = 1e-6f;                // the q_a and kv_a norms'
  float scale = 1.f;                // softmax scale
  BackboneMatrix q;                 // [heads * (nope_dim + rope_dim), hidden] when q_lora_rank is 0
  BackboneMatrix q_a, q_b;          // else [q_lora_rank, hidden] and [heads * (nope_dim + rope_dim), q_lora_rank]
  BackboneMatrix kv_a;              // [kv_lora_rank + rope_dim, hidden]
  BackboneMatrix uk_t;              // [heads * kv_lora_rank, nope_dim]
  BackboneMatrix uv;                // [heads * v_dim, kv_lora_rank]
  BackboneMatrix o;                 // [hidden, heads * v_dim]
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
  int kv_layer = 0;                 // this layer's row of the KV run
  int latent_dim() const { return kv_lora_rank + rope_dim; }
};

inline constexpr int kMaxDeltaValueDim = 1024;

// Gated DeltaNet (models/delta_rule.py): a causal depthwise conv, L2-normed q and k, the gated delta rule
// on a [value_heads, key_dim, value_dim] state, a gated RMSNorm.
struct DeltaNetMixer {
  int key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0, conv_kernel = 0;
  float eps = 1e-6f;                 // the output norm's
  BackboneMatrix qkv, z, b, a, out;
  const float* conv = nullptr;       // [channels, conv_kernel]; column conv_kernel-1 multiplies this token
  const float* neg_decay = nullptr;  // [value_heads]: -exp(A_log)
  const float* dt_bias = nullptr;    // [value_heads]
  const float* norm = nullptr;       // [value_dim]
  float* conv_state = nullptr;       // [channels, conv_kernel-1]: the last inputs, oldest first
  float* recurrent = nullptr;        // [value_heads, key_dim, value_dim]
  int channels() const { return 2 * key_heads * key_dim + value_heads * value_dim; }
};

struct Router {
  BackboneMatrix gate;              // [experts, hidden]; rows == 0: no routed experts
  Scoring scoring = Scoring::Softmax;
  TopkMethod method = TopkMethod::Greedy;
  int top_k = 0, n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  float scaling = 1.f;
  const float* score_bias = nullptr;  // [experts]: added to the scores to choose, not to weigh
  const float* logit_bias = nullptr;  // [experts]: the router Linear's bias, added to its logits
};

// Routed experts (router.gate set) plus an optional shared expert, or a dense MLP (no router).
struct Ffn {
  Router router;
  BackboneMatrix gate, up, down;    // the shared expert's or the dense MLP's; rows == 0: none
  BackboneMatrix shared_gate;       // [1, hidden]: the shared expert's output times sigmoid(h . shared_gate)
};

struct DecodeLayer {
  int hidden = 0;
  float eps = 1e-6f;
  const float *input_norm = nullptr, *post_norm = nullptr;
  enum Mixer : int { Attention = 0, Latent = 1, DeltaNet = 2 };
  Mixer mixer = Attention;          // which of the three below this layer runs
  AttentionMixer attention;
  LatentMixer latent;
  DeltaNetMixer delta;
  Ffn ffn;
};

// Every attention layer's cache rows: K and V [attention layers, kv_heads, rows, head_dim] of dtype, position p
// at row p; an int8 cache's scales [attention layers, kv_heads, rows]. Strides in elements.
struct KvRun {
  KvDtype dtype = KvDtype::F32;
  void *k = nullptr, *v = nullptr;
  float *k_scale = nullptr, *v_scale = nullptr;
  int64_t rows = 0;
  int64_t k_layer_stride = 0, v_layer_stride = 0, k_head_stride = 0, v_head_stride = 0;
  int64_t scale_layer_stride = 0, scale_head_stride = 0;
};

// What a decode step's layers attend over: the KV cache's run (full attention, latent attention) and the
// window ring's (sliding-window layers kept bounded, kv_cache.WindowCache): there position p is at rows
// p % ring and p % ring + ring, ring = window.rows / 2, so any window is one contiguous span.
struct KvRuns {
  KvRun full;
  KvRun window;
};

// A decode step's final RMSNorm and lm_head (the logits of the token).
struct DecodeHead {
  const float* norm;
  float eps;
  BackboneMatrix lm_head;  // [vocab, hidden]
};

// The routed experts' side of decode_layers: records held in an expert ring.
struct LoopExperts {
  RecordLayout layout;
  ExpertActivation act;
  Isa isa;
  int threads;
  const ExpertRing* ring;
  const int32_t* slot_of;  // [layers, n_experts]: the slot whose record is held and checked, else -1
  int n_experts;
  float* scratch;          // moe_scratch_floats(layout, top_k, 1, threads)
};

struct DecodeLayersResult {
  int stop;         // the layer whose routed experts are left to the caller, or n_layers when done
  double kernel_s;  // time in the experts' kernel
};

// Scratch floats one layer's step needs (decode_layers takes the largest over its layers).
uint64_t decode_layer_scratch_floats(const DecodeLayer& layer);
// x += the layer's mixer; h = the post-attention norm of x; an MoE layer's top-k into topk_weights /
// topk_ids. Its shared expert or dense MLP is decode_mlp's, its routed experts the caller's.
void decode_mixer(const DecodeLayer& layer, const KvRuns& kv, float* x, float* h, int pos, const float* cos,
                  const float* signed_sin, float* topk_weights, int32_t* topk_ids, float* scratch, int threads,
                  Isa isa);
// x += the layer's shared expert or dense MLP of h (nothing for an MoE layer without one); scratch as
// decode_mixer's.
void decode_mlp(const DecodeLayer& layer, const float* h, float* x, float* scratch, int threads, Isa isa);
// logits = lm_head(RMSNorm(x)); scratch holds hidden floats.
void decode_head(const DecodeHead& head, const float* x, float* logits, float* scratch, int threads, Isa isa);

// One decode step from layer `first` on, at position pos (cos / signed_sin: its RoPE tables, rot_dim each).
// x [hidden] is the residual stream, updated in place; h [hidden] receives each layer's post-attention norm.
// Each MoE layer's router writes topk_weights / topk_ids [n_layers, top_k] (its row), then its shared
// expert and its routed experts (ascending expert id, from the ring while their records are held) are
// added into x. The loop stops at the first MoE layer whose experts it cannot run (experts null, or a
// record not held): that layer's mixer and router are done, h and its top-k are set, and the caller adds
// its shared expert (decode_mlp) and then its routed experts into x, in that order, and calls again from
// the next layer. The shared expert is left to the caller so that it can run while the caller's reads
// are in flight. With a head, the call that finishes the last layer also writes logits [vocab].
DecodeLayersResult decode_layers(const DecodeLayer* layers, int n_layers, int first, const KvRuns& kv,
                                 const LoopExperts* experts, const DecodeHead* head, float* x, float* h, int pos,
                                 const float* cos, const float* signed_sin, float* topk_weights, int32_t* topk_ids,
                                 int top_k_stride, float* logits, float* scratch, int threads, Isa isa);

// y [rows] = W x for one token, whatever W's kind.
void project(const BackboneMatrix& w, const float* x, float* y, int threads, Isa isa);
// Rows first..first+count-1 of w, as a matrix of their own (no copy).
BackboneMatrix row_slice(const BackboneMatrix& w, int first, int count);
// Several matrices of one x (q, k and v; the DeltaNet's four inputs) in one parallel region, their rows
// split evenly over the threads.
void project_together(const BackboneMatrix* const* ws, float* const* ys, int count, const float* x, int threads,
                      Isa isa);
// y = w * x / rms(x) over n values (float32; the sum of squares in double); rms_norm.cpp.
void rms_norm(const float* x, const float* w, int n, float eps, float* y);
// The same for each of `rows` rows of n values (x and y [rows, n], y may be x), over the threads.
void rms_norm_rows(const float* x, const float* w, int64_t rows, int n, float eps, float* y, int threads);

// The Gated DeltaNet mixer's step (decode_delta.cpp): out [hidden] = the mixer's output for normed input h;
// its conv window and recurrent state move on by this token.
void delta_net_step(const DeltaNetMixer& m, const float* h, float* out, float* scratch, int threads, Isa isa);
uint64_t delta_net_scratch_floats(const DeltaNetMixer& m);

// The gated delta rule over a prompt's tokens (delta_rule.cpp), the prefill's form of the step above: for each
// token t in order and value head j, which reads key head j / (value_heads / key_heads), head j's state takes
// t's step and out[t, j] is its read. Agrees with models/delta_rule.py's two torch forms to float rounding.
struct DeltaRuleTokens {
  int tokens = 0, key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;
  const float *q = nullptr, *k = nullptr;  // [tokens, key_heads, key_dim]: L2-normed, q also by 1/sqrt(key_dim)
  const float* v = nullptr;                // [tokens, value_heads, value_dim], tokens v_token_stride floats apart
  int64_t v_token_stride = 0;
  const float *g = nullptr, *beta = nullptr;  // [tokens, value_heads]: log-decays (<= 0) and write strengths
  float* out = nullptr;                    // [tokens, value_heads, value_dim]
  float* state = nullptr;                  // [value_heads, key_dim, value_dim], updated in place
};
void gated_delta_rule(const DeltaRuleTokens& r, int threads, Isa isa);

}  // namespace mosaic
