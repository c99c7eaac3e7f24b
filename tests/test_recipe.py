"""Recipes: every family's arch block reads into one, every key is read or refused, and the RoPE kinds
equal transformers' own tables."""

import json

import pytest
import torch

from builders import CONFIGS
from mosaic_runtime.models.rope import Rotary, inverse_frequencies
from mosaic_runtime.recipe import (Attention, DeltaNet, LatentAttention, QkNorm, Rope, Scoring, TopkMethod,
                                   read_recipe)
from mosaic_shatter.architectures import architecture_for

REAL = {  # config -> (layers, attention layers, MoE layers, what sets it apart)
    "qwen3-30b-a3b.config.json": (48, 48, 48, lambda r: r.layers[0].mixer.qk_norm is QkNorm.HEAD),
    "qwen1.5-moe-a2.7b.config.json": (24, 24, 24, lambda r: r.layers[0].mixer.qkv_bias and r.layers[0].ffn.shared_gate),
    "mixtral-8x7b-v0.1.config.json": (32, 32, 32, lambda r: r.layers[0].ffn.router.norm_topk_prob),
    "olmoe-1b-7b-0924.config.json": (16, 16, 16, lambda r: r.layers[0].mixer.qk_norm is QkNorm.PROJECTION),
    "glm-4.5-air.config.json": (46, 46, 45, lambda r: r.layers[1].ffn.router.scoring is Scoring.SIGMOID
                                and r.layers[1].ffn.router.method is TopkMethod.NOAUX_TC and r.layers[0].ffn.router is None
                                and r.layers[0].mixer.rope.rot_dim == 64 and not r.layers[0].mixer.o_bias),
    "qwen3.5-35b-a3b.config.json": (40, 10, 40, lambda r: r.layers[0].mixer.channels == 8192 and r.norm_offset == 1.0),
    "qwen3.5-35b-a3b-text.config.json": (40, 10, 40, lambda r: r.layers[3].mixer.output_gate),
    "qwen3-next-80b-a3b-instruct.config.json": (48, 12, 48, lambda r: r.layers[0].mixer.fused_projections),
    "deepseek-v2-lite.config.json": (27, 27, 26, lambda r: isinstance(r.layers[0].mixer, LatentAttention)
                                     and r.layers[0].mixer.q_lora_rank == 0 and r.layers[0].mixer.latent_dim == 576
                                     and r.layers[1].ffn.router.scoring is Scoring.SOFTMAX
                                     and r.layers[1].ffn.intermediate == 2 * 1408),
    "deepseek-v3.config.json": (61, 61, 58, lambda r: r.layers[0].mixer.q_lora_rank == 1536
                                and r.layers[0].mixer.rope_interleave and r.layers[2].ffn.router is None
                                and r.layers[3].ffn.router.method is TopkMethod.NOAUX_TC
                                and r.layers[3].ffn.router.scaling == 2.5 and r.layers[3].ffn.router.score_bias),
    "kimi-k2-instruct.config.json": (61, 61, 60, lambda r: r.layers[1].ffn.router.experts == 384
                                     and r.layers[0].mixer.heads == 64),
}


def arch_of(config: str) -> dict:
    cfg = {k: v for k, v in json.loads((CONFIGS / config).read_text()).items() if not k.startswith("_")}
    return architecture_for(cfg).arch_block(cfg, None)


@pytest.mark.parametrize("config", sorted(REAL))
def test_every_family_reads_into_a_recipe(config):
    layers, attention, moe, trait = REAL[config]
    recipe = read_recipe(arch_of(config))
    assert len(recipe.layers) == layers and len(recipe.attention_layers) == attention
    assert sum(layer.ffn.router is not None for layer in recipe.layers) == moe
    assert trait(recipe)


def test_an_unknown_key_with_a_value_is_refused_and_a_null_one_ignored():
    arch = arch_of("qwen3-30b-a3b.config.json")
    read_recipe({**arch, "attention_chunk_size": None, "future_flag": False})
    with pytest.raises(NotImplementedError, match="attention_chunk_size = 8192"):
        read_recipe({**arch, "attention_chunk_size": 8192})


@pytest.mark.parametrize("key, value, message", [
    ("rope", {"theta": 1e6, "type": "longrope", "scaling": {}, "partial_rotary_factor": 1.0}, "rope type 'longrope'"),
    ("hidden_act", "gelu", "hidden_act = 'gelu'"),
    ("scoring_func", "sparsemixer", "scoring_func = 'sparsemixer'"),
    ("topk_method", "random", "topk_method = 'random'"),
    ("qk_norm", "layer", "qk_norm = 'layer'"),
    ("layer_types", ["mamba"] * 48, "layer type 'mamba'"),
    ("layer_kinds", ["moe"] * 47, "47 layer kinds"),
    ("num_experts_per_tok", 65, "top-65"),
])
def test_what_the_runtime_cannot_run_is_refused_by_name(key, value, message):
    arch = {**arch_of("qwen3-30b-a3b.config.json"), key: value}
    with pytest.raises(NotImplementedError, match=message):
        read_recipe(arch)


@pytest.mark.parametrize("change, message", [
    ({"rope": {"type": "default"}}, "'theta' is missing"),  # found by benchmarks/fuzz.py
    ({"num_attention_heads": "32"}, "TypeError"),
    ({"linear_attention": {"num_key_heads": 2}}, "is missing"),
])
def test_a_malformed_arch_block_is_refused_not_raised_through(change, message):
    with pytest.raises(NotImplementedError, match=message):
        read_recipe({**arch_of("qwen3-30b-a3b.config.json"), **change})


def test_sliding_and_biases_are_read_not_ignored():
    """attention_bias and sliding_window were once written and ignored: now they shape the recipe."""
    arch = arch_of("qwen3-30b-a3b.config.json")
    arch.update(attention_bias=True, attention_out_bias=True, sliding_window=512,
                layer_types=["sliding_attention"] * 24 + ["full_attention"] * 24)
    recipe = read_recipe(arch)
    att: Attention = recipe.layers[0].mixer
    assert att.qkv_bias and att.o_bias and att.sliding_window == 512
    assert recipe.layers[47].mixer.sliding_window is None


def test_a_vault_from_before_qk_norm_had_values_reads_true_as_per_head():
    arch = {**arch_of("qwen3-30b-a3b.config.json"), "qk_norm": True}
    assert read_recipe(arch).layers[0].mixer.qk_norm is QkNorm.HEAD


@pytest.mark.parametrize("rope_type, params", [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}),
    ("yarn", {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_tables_equal_transformers(rope_type, params, partial):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    head_dim, theta = 128, 1e6
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", head_dim=head_dim, max_position_embeddings=131072, num_attention_heads=4,
        rope_parameters={"rope_type": rope_type, "rope_theta": theta, "partial_rotary_factor": partial, **params})
    arch = architecture_for(cfg.to_dict()).arch_block(cfg.to_dict(), None)
    rope = read_recipe(arch).layers[0].mixer.rope
    assert rope.kind == rope_type and rope.rot_dim == int(head_dim * partial)
    ours, factor = inverse_frequencies(rope)
    if rope_type == "default":
        want, want_factor = 1.0 / (theta ** (torch.arange(0, rope.rot_dim, 2).float() / rope.rot_dim)), 1.0
    else:
        want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](cfg)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-6)


def test_rotary_tables_carry_the_attention_factor():
    rope = Rope(1e4, 64, "yarn", {"factor": 8.0, "original_max_position_embeddings": 256}, 2048)
    rot = Rotary(rope, 16)
    _, factor = inverse_frequencies(rope)
    assert factor > 1 and torch.allclose(rot.cos[0], torch.full((64,), factor))
    assert isinstance(read_recipe(arch_of("qwen3.5-35b-a3b.config.json")).layers[0].mixer, DeltaNet)


def test_latent_attention_softmax_scale_follows_deepseek_yarn():
    """DeepSeek scales the softmax by mscale(factor, mscale_all_dim)^2 under YaRN: V2-Lite's 0.707 and
    V3's 1.0 at factor 40, as transformers' yarn_apply_mscale."""
    import math
    for config, m in (("deepseek-v2-lite.config.json", 0.707), ("deepseek-v3.config.json", 1.0)):
        att = read_recipe(arch_of(config)).layers[0].mixer
        assert att.rope.rot_dim == 64 and att.rope.kind == "yarn"
        assert att.scale == pytest.approx(192 ** -0.5 * (0.1 * m * math.log(40) + 1) ** 2, rel=1e-12)


@pytest.mark.parametrize("change, message", [
    (dict(scoring_func="sigmoid"), "DeepSeek-V2 routing by sigmoid"),
    (dict(topk_method="noaux_tc"), "DeepSeek-V2 routing by softmax / noaux_tc"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_deepseek_settings_the_runtime_cannot_run_are_refused_at_probe(change, message):
    from mosaic_shatter.architectures import UnsupportedModel
    cfg = {k: v for k, v in json.loads((CONFIGS / "deepseek-v2-lite.config.json").read_text()).items()
           if not k.startswith("_")}
    with pytest.raises(UnsupportedModel, match=message):
        architecture_for(cfg).arch_block({**cfg, **change}, None)
