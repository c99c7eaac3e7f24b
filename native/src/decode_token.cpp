// A decode step's layer loop in one call: each layer's mixer and router (decode_mixer), its shared expert or
// dense MLP (decode_mlp), then its routed experts straight from the ring into the residual stream, while
// every record they need is held. The loop stops at the first MoE layer it cannot finish alone (an expert
// whose record is not held, or no ring at all), with that layer's h and top-k left for the caller, which
// starts its reads, adds its shared expert and routed experts and calls again from the next; the call that
// finishes the last layer also runs the final norm and lm_head when given a head.
// It exists for speed only: per layer, the Python loop it replaces cost as much as 0.1 ms of interpreter
// work, most of it cache misses after the weights streamed through.
#include "mosaic/decode.h"
#include "mosaic/expert_ring.h"

namespace mosaic {

DecodeLayersResult decode_layers(const DecodeLayer* layers, int n_layers, int first, const KvRuns& kv,
                                 const LoopExperts* experts, const DecodeHead* head, float* x, float* h, int pos,
                                 const float* cos, const float* signed_sin, float* topk_weights, int32_t* topk_ids,
                                 int top_k_stride, float* logits, float* scratch, int threads, Isa isa) {
  DecodeLayersResult result{n_layers, 0.0};
  for (int i = first; i < n_layers; ++i) {
    const DecodeLayer& L = layers[i];
    float* w = topk_weights + static_cast<int64_t>(i) * top_k_stride;
    int32_t* ids = topk_ids + static_cast<int64_t>(i) * top_k_stride;
    decode_mixer(L, kv, x, h, pos, cos, signed_sin, w, ids, scratch, threads, isa);
    const int k = L.ffn.router.top_k;
    if (L.ffn.router.gate.rows == 0) {  // a dense layer: its MLP, and done
      decode_mlp(L, h, x, scratch, threads, isa);
      continue;
    }
    if (experts == nullptr) return {i, result.kernel_s};
    // The experts in ascending id (the combine order of every executor), each from its held record.
    int order[64];
    for (int j = 0; j < k; ++j) {
      int at = j;
      for (; at > 0 && ids[order[at - 1]] > ids[j]; --at) order[at] = order[at - 1];
      order[at] = j;
    }
    static const int32_t token = 0;
    float sorted_w[64];
    ExpertTask tasks[64];
    for (int j = 0; j < k; ++j) {
      const int32_t e = ids[order[j]];
      const int32_t slot = e >= 0 && e < experts->n_experts ? experts->slot_of[static_cast<int64_t>(i) * experts->n_experts + e] : -1;
      if (slot < 0) return {i, result.kernel_s};  // not held: the caller reads it
      sorted_w[j] = w[order[j]];
      tasks[j] = {experts->ring->slot(slot), &token, &sorted_w[j], 1, -1};
    }
    decode_mlp(L, h, x, scratch, threads, isa);  // the shared expert first: the caller's order too
    MoeTiming timing;
    moe_experts(experts->layout, experts->act, h, L.hidden, tasks, k, x, experts->scratch, experts->isa,
                experts->threads, nullptr, &timing);
    result.kernel_s += timing.total_s;
  }
  if (head != nullptr) decode_head(*head, x, logits, scratch, threads, isa);
  return result;
}

}  // namespace mosaic
