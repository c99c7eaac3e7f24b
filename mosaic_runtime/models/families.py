"""Where each family keeps its backbone tensors. The arch block says what the layers are made of
(recipe.py); this table is all the runtime knows of a family beyond that.

The converter writes backbone tensors under their checkpoint names, except where it renames them to the
common spelling (Qwen3.5's `model.language_model.` prefix, Mixtral's `block_sparse_moe.gate`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightNames:
    """Tensor names; `{i}` is the layer index. Attention tensors are `attention` + q_proj / k_proj / v_proj /
    o_proj (.weight, .bias) and q_norm / k_norm (.weight); latent attention's `attention` + q_proj (or
    q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; Gated
    DeltaNet ones `delta_net` + in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (or Qwen3-Next's
    in_proj_qkvz, in_proj_ba), conv1d, A_log, dt_bias, norm, out_proj; MLPs (dense or shared expert) their
    prefix + gate_proj / up_proj / down_proj."""

    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer: str = "model.layers.{i}."
    input_norm: str = "input_layernorm.weight"
    post_norm: str = "post_attention_layernorm.weight"
    attention: str = "self_attn."
    delta_net: str = "linear_attn."
    router: str = "mlp.gate.weight"
    router_bias: str = "mlp.gate.e_score_correction_bias"
    router_logit_bias: str = "mlp.gate.bias"
    sinks: str = "sinks"  # after `attention`
    shared_expert: str = "mlp.shared_expert."
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"
    dense_mlp: str = "mlp."

    def of(self, layer: int, name: str) -> str:
        return self.layer.format(i=layer) + name


FAMILIES: dict[str, WeightNames] = {
    "qwen3_moe": WeightNames(),  # Qwen3-30B-A3B, Qwen3-235B-A22B (and FP8 releases)
    "qwen2_moe": WeightNames(),  # Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B
    "olmoe": WeightNames(),  # OLMoE-1B-7B
    "mixtral": WeightNames(),  # Mixtral-8x7B, 8x22B (router renamed to mlp.gate by the converter)
    "glm4_moe": WeightNames(shared_expert="mlp.shared_experts."),  # GLM-4.5, 4.5-Air, 4.6
    "deepseek_v2": WeightNames(shared_expert="mlp.shared_experts."),  # DeepSeek-V2, V2-Lite
    "deepseek_v3": WeightNames(shared_expert="mlp.shared_experts."),  # DeepSeek-V3, R1
    "kimi_k2": WeightNames(shared_expert="mlp.shared_experts."),  # Kimi-K2, K2-Thinking
    "qwen3_next": WeightNames(),  # Qwen3-Next-80B-A3B
    "qwen3_5_moe": WeightNames(),  # Qwen3.5 / 3.6-35B-A3B (multimodal save, prefix removed by the converter)
    "qwen3_5_moe_text": WeightNames(),  # Qwen3.5 / 3.6 text-only saves
    "gpt_oss": WeightNames(router="mlp.router.weight", router_logit_bias="mlp.router.bias"),  # gpt-oss-20b, 120b
}
