"""The family runner's table (tests/test_families.py): for every supported model_type, tiny checkpoints that
transformers writes (each case a corner of the recipe), the tolerance its logits are held to, and the
real-scale configs its probe is checked on. A new family is one row here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from builders import HYBRID_BASE, tiny_gpt_oss, tiny_hybrid, tiny_model

BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40, intermediate_size=112)
# transformers' DeepSeek models take head_dim for the rope width
MLA = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, intermediate_size=112,
           n_shared_experts=1, first_k_dense_replace=1, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, head_dim=8, v_head_dim=12)
ATTENTION_ATOL = 5e-5  # float32 end to end; logits of magnitude ~10
# Both sides run a chunked delta rule in float32 with different formulations (transformers' UT transform
# against our triangular solve), so their rounding differs more than in plain attention.
HYBRID_ATOL = 1e-3


@dataclass(frozen=True)
class Case:
    model_type: str
    config: dict
    atol: float = ATTENTION_ATOL
    layouts: tuple[str, ...] = ("per-expert", "fused")  # what transformers writes: per expert, or fused 3-D
    seed: int = 0
    quants: tuple[str, ...] = ("q4", "fp8")  # the vaults each layout is converted to

    def build(self, path: Path, layout: str) -> Path:
        if self.model_type in ("qwen3_next", "qwen3_5_moe"):  # the release layouts (tiny_hybrid's docstring)
            return tiny_hybrid(self.model_type, path, seed=self.seed, **self.config)
        if self.model_type == "gpt_oss":  # "mxfp4": the release's layout; "fused": transformers' float save
            return tiny_gpt_oss(path, mxfp4=layout == "mxfp4", seed=self.seed, **{**BASE, **self.config})
        return tiny_model(self.model_type, path, fused=layout == "fused", seed=self.seed, **{**BASE, **self.config})


CASES = {
    "qwen3_moe": Case("qwen3_moe", dict(MOE, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen3_moe-yarn-tied-mqa": Case("qwen3_moe", dict(
        MOE, norm_topk_prob=False, num_key_value_heads=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}), layouts=("per-expert",)),
    "qwen2_moe": Case("qwen2_moe", dict(MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen2_moe-window": Case("qwen2_moe", dict(MOE, shared_expert_intermediate_size=48, use_sliding_window=True,
                                               sliding_window=24, max_window_layers=3), layouts=("per-expert",)),
    "mixtral": Case("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=40)),
    "mixtral-window-linear-rope": Case("mixtral", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=40, sliding_window=24,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), layouts=("per-expert",)),
    "olmoe": Case("olmoe", dict(num_experts=6, num_experts_per_tok=2, intermediate_size=40)),
    "olmoe-bias-clip": Case("olmoe", dict(num_experts=6, num_experts_per_tok=3, intermediate_size=40,
                                          attention_bias=True, clip_qkv=0.8, norm_topk_prob=True),
                            layouts=("per-expert",)),
    "glm4_moe": Case("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                                      intermediate_size=112, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                      topk_group=1, routed_scaling_factor=2.5, attention_bias=True)),
    "glm4_moe-qk-norm-llama3": Case("glm4_moe", dict(
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, intermediate_size=112,
        n_shared_experts=2, first_k_dense_replace=2, n_group=4, topk_group=2, norm_topk_prob=False,
        use_qk_norm=True, num_hidden_layers=4,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), layouts=("per-expert",)),
    # latent attention: rank, nope, rope and v widths all different; YaRN with DeepSeek's mscale
    "deepseek_v2": Case("deepseek_v2", dict(
        MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 128})),
    "deepseek_v2-lite": Case("deepseek_v2", dict(MLA, q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3),
                             layouts=("per-expert",)),
    "deepseek_v3": Case("deepseek_v3", dict(
        MLA, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128})),
    "deepseek_v3-rope-halves": Case("deepseek_v3", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2,
                                                        first_k_dense_replace=2, num_hidden_layers=4,
                                                        rope_interleave=False), layouts=("per-expert",)),
    "qwen3_next": Case("qwen3_next", dict(mlp_only_layers=[1], intermediate_size=96), HYBRID_ATOL, ("per-expert",)),
    "qwen3_5_moe": Case("qwen3_5_moe", dict(num_hidden_layers=4), HYBRID_ATOL, ("fused",), seed=1),
    # value heads of 48: the decode step's delta rule takes a block of 32 columns and a ragged 16
    "qwen3_5_moe_text": Case("qwen3_5_moe_text", dict(HYBRID_BASE, num_key_value_heads=4, linear_num_value_heads=2,
                                                      linear_value_head_dim=48), HYBRID_ATOL, seed=2),
    # sinks, a window shorter than the prompt on alternate layers, YaRN without truncation, experts wider
    # than the model (I != H), MXFP4 passed through
    "gpt_oss": Case("gpt_oss", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=96, sliding_window=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}),
        layouts=("mxfp4", "fused"), quants=("q4", "fp8", "mxfp4")),
}


@dataclass(frozen=True)
class Skeleton:
    """A real config (tests/data/configs) and what ../shared/checkpoints/TENSORS.md computes for it."""

    config: str
    tensors: int
    q4: int  # Q4 g32 vault bytes (codes + one f16 scale per 32): TENSORS.md's "Q4 vault g32"
    backbone: int  # bf16 backbone bytes, F32 tensors at 4 B, MTP experts excluded (probe leaves out the rest
    # of an MTP layer too)


SKELETONS = {
    "mixtral": Skeleton("mixtral-8x7b-v0.1.config.json", 995, 25_367_150_592, 3_211_272_192),
    "qwen2_moe": Skeleton("qwen1.5-moe-a2.7b.config.json", 4_659, 7_007_109_120, 3_717_402_624),
    "olmoe": Skeleton("olmoe-1b-7b-0924.config.json", 3_219, 3_623_878_656, 953_421_824),
    "glm4_moe": Skeleton("glm-4.5-air.config.json", 18_327, 56_056_872_960, 14_712_122_368),
    "deepseek_v2": Skeleton("deepseek-v2-lite.config.json", 5_291, 8_097_103_872, 2_623_265_792),
    # the FP8 release: its backbone as bf16, which the converter writes
    "deepseek_v3": Skeleton("deepseek-v3.config.json", 91_991, 367_823_683_584, 38_613_601_280),
    # not in TENSORS.md, so computed from the config: 60 MoE layers x 384 experts x 24,772,608 B (Q4 g32 of
    # 2048 x 7168 three times); bf16 backbone 11,722,185,728 params x 2 B plus 60 x 384 F32 biases at 4 B
    "kimi_k2": Skeleton("kimi-k2-instruct.config.json", 139_583, 570_760_888_320, 23_444_463_616),
    # a text-only save of Qwen3.5-35B-A3B: TENSORS.md's tensors and backbone less the MTP head and vision tower
    "qwen3_5_moe_text": Skeleton("qwen3.5-35b-a3b-text.config.json", 693, 18_119_393_280, 4_896_721_536),
}
