"""Random-weight checkpoints with a real model's per-layer geometry and a few layers, for the benchmarks:
what a decoded token reads per layer is the real model's, the model is small enough to build here.

    python benchmarks/geometries.py NAME OUT    # build one (bf16, 1 GiB shards)

Weights are bf16 N(0, 0.02) (norms ones, DeltaNet decay terms small), the vocabulary 8192 (the real one
would make lm_head most of an 8-layer model). The tensor names and layouts are the releases' own, from
the skeleton builders of tests/builders.py, so every converter (Mosaic's, llama.cpp's) reads them as it
reads the real checkpoints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 8192

GEOMETRIES = {
    # Qwen3-30B-A3B: 128 experts of 768, top-8
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "norm_topk_prob": True,
        "rope_theta": 1e6, "rms_norm_eps": 1e-6},
    # Qwen3.5-35B-A3B (and 3.6): Gated DeltaNet layers with one gated-attention layer in four, 256 experts
    # of 512 plus a gated shared expert, top-8; the release's multimodal layout, text tensors only
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "attn_output_gate": True, "mtp_num_hidden_layers": 0}},
    # GLM-4.5-Air: 96 query heads of 128 over 8 KV heads with q/k/v biases, half-rotary, a dense first
    # layer, then experts of 1408 (here 32 of its 128 a layer: a token reads 8 whatever the count) with a
    # shared expert, sigmoid routing with a score bias
    "glm-4.5-air": {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 32, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "attention_bias": True, "partial_rotary_factor": 0.5, "use_qk_norm": False,
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0},
    # gpt-oss-20b: 64 query heads of 64 over 8 KV heads with biases and sinks, 128-token windows on alternate
    # layers, 32 experts of 2880 with biases, top-4, released in MXFP4 (blocks and E8M0 scales, random here)
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 2880,
        "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
        "sliding_window": 128, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "initial_context_length": 4096,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}},
    # DeepSeek-V3 / R1 (Kimi-K2 shares the layer): multi-head latent attention (128 heads, q rank 1536, a
    # cached latent of 512 + 64), a dense first layer of 18432, then experts of 2048 (here 32 of its 256 a
    # layer: a token reads 8 whatever the count) with a shared expert, sigmoid routing with a score bias
    # and groups
    "deepseek-v3": {
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 32, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "norm_topk_prob": True, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rope_theta": 10000, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 0,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}},
}
LAYERS = {"deepseek-v3": 4}  # a smaller model where one layer is 3 GB of bf16 source; others 8


def config(name: str, layers: int) -> dict:
    cfg = json.loads(json.dumps(GEOMETRIES[name]))
    text = cfg.get("text_config", cfg)
    text.update(num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False,
                hidden_act="silu")
    cfg.update(torch_dtype="bfloat16", vocab_size=VOCAB, tie_word_embeddings=False)
    if cfg["model_type"] == "gpt_oss":
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return cfg


def tensors(cfg: dict) -> list[tuple[str, str, list[int]]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from builders import decoder_tensors, deepseek_tensors, gpt_oss_tensors, hybrid_tensors, qwen3_moe_tensors
    kind = cfg["model_type"]
    if kind == "gpt_oss":
        return gpt_oss_tensors(cfg)
    if kind == "qwen3_moe":
        return qwen3_moe_tensors(cfg, fp8=False)
    if kind == "deepseek_v3":
        return deepseek_tensors(cfg)
    if kind == "qwen3_5_moe":  # text only: no vision tower, no MTP head (llama.cpp's converter: --no-mtp)
        return [t for t in hybrid_tensors(cfg) if not t[0].startswith(("model.visual.", "mtp."))]
    return decoder_tensors(cfg)


def build(name: str, path: Path, layers: int = 8) -> Path:
    """The checkpoint at path (built once)."""
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = config(name, layers)
    if cfg["model_type"] == "qwen3_5_moe":
        cfg["vision_config"] = {"depth": 0, "hidden_size": 16, "intermediate_size": 16}  # no tower: none is built
    g = torch.Generator().manual_seed(0)
    shard, size, n, weight_map = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, n
        file = f"model-{n + 1:05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
        shard, size, n = {}, 0, n + 1

    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
    for tensor, dtype, shape in tensors(cfg):
        if tensor.endswith("_blocks"):  # MXFP4 codes, any
            t = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif tensor.endswith("_scales"):  # E8M0 around 2^-7: weights of std ~0.02 like the others
            t = torch.randint(118, 123, shape, generator=g, dtype=torch.uint8)
        elif tensor.endswith(("A_log", "dt_bias", "e_score_correction_bias")):
            t = torch.rand(*shape, generator=g) * 0.1  # a slow decay, a small bias
        elif len(shape) == 1:
            t = torch.ones(*shape)  # norms
        else:
            t = torch.randn(*shape, generator=g) * 0.02
        shard[tensor] = t.to(dtypes[dtype])
        size += shard[tensor].numel() * shard[tensor].element_size()
        if size >= 1 << 30:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


if __name__ == "__main__":
    build(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
