"""Checkpoints built at test time: tiny real ones with transformers, block-FP8 re-encodings of them, and
real-scale "skeletons" (real safetensors headers and tensor names, sparse holes for data)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mosaic_runtime.vault.quant import quantize_fp8, quantize_mxfp4

CONFIGS = Path(__file__).parent / "data" / "configs"

TINY = dict(vocab_size=320, hidden_size=72, intermediate_size=112, moe_intermediate_size=40, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
            max_position_embeddings=256, norm_topk_prob=True, bos_token_id=1, eos_token_id=2)


def tiny_qwen3_moe(path: Path, *, fused: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0,
                   **overrides) -> Path:
    """A randomly initialised Qwen3-MoE saved by transformers (per-expert, or fused 3-D experts)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen3_moe", **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(path, save_original_format=not fused)
    return Path(path)


def to_int4_pack(src: Path, dst: Path, packed: str = r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$") -> Path:
    """Re-encode a checkpoint as Kimi-K2-Thinking's release does: the routed experts (or what `packed`
    matches) in compressed-tensors' pack-quantized int4 (symmetric, groups of 32, packed by
    compressed-tensors itself), everything else as it was, bf16."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if re.search(packed, name):
            w = t.float().view(t.shape[0], -1, 32)
            scale = (w.abs().amax(-1) / 7).to(torch.bfloat16).clamp_min(1e-4)  # [rows, cols / 32]
            q = torch.round(w / scale.float()[..., None]).clamp(-8, 7).to(torch.int8).reshape(t.shape)
            base = name[: -len(".weight")]
            out[base + ".weight_packed"] = pack_to_int32(q, 4)
            out[base + ".weight_scale"] = scale
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                  "group_size": 32, "dynamic": False, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
        "kv_cache_scheme": None}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _fp8_target(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".mlp.gate." not in name


def to_block_fp8(src: Path, dst: Path, scale_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Re-encode a checkpoint as Qwen's and DeepSeek-V3's block-FP8 releases do: attention, MLP and expert
    Linears in E4M3 with `weight_scale_inv` [ceil(out/128), ceil(in/128)]; router, norms, embeddings and
    lm_head unchanged."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if _fp8_target(name):
            codes, scales = quantize_fp8(t.float())
            out[name] = codes.view(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = scales.to(scale_dtype)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# --- skeletons ----------------------------------------------------------------------------------
def qwen3_moe_tensors(cfg: dict, fp8: bool) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a Qwen3-MoE checkpoint, as TENSORS.md lists them."""
    h, inter, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg.get("num_experts", 0)
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    out = [("model.embed_tokens.weight", "BF16", [cfg["vocab_size"], h]), ("model.norm.weight", "BF16", [h])]
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", "BF16", [cfg["vocab_size"], h]))

    def linear(name, rows, cols):
        if not fp8:
            return [(name, "BF16", [rows, cols])]
        return [(name, "F8_E4M3", [rows, cols]), (name + "_scale_inv", "BF16", [-(-rows // 128), -(-cols // 128)])]

    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += linear(p + "self_attn.q_proj.weight", heads * hd, h)
        out += linear(p + "self_attn.k_proj.weight", kv * hd, h)
        out += linear(p + "self_attn.v_proj.weight", kv * hd, h)
        out += linear(p + "self_attn.o_proj.weight", h, heads * hd)
        out += [(p + "self_attn.q_norm.weight", "BF16", [hd]), (p + "self_attn.k_norm.weight", "BF16", [hd]),
                (p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h])]
        if i in dense or (i + 1) % step:  # a dense MLP layer (transformers' rule)
            out += linear(p + "mlp.gate_proj.weight", cfg["intermediate_size"], h)
            out += linear(p + "mlp.up_proj.weight", cfg["intermediate_size"], h)
            out += linear(p + "mlp.down_proj.weight", h, cfg["intermediate_size"])
            continue
        out.append((p + "mlp.gate.weight", "BF16", [n_exp, h]))
        for e in range(n_exp):
            q = f"{p}mlp.experts.{e}."
            out += linear(q + "gate_proj.weight", inter, h)
            out += linear(q + "up_proj.weight", inter, h)
            out += linear(q + "down_proj.weight", h, inter)
    return out


_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "U8": 1}


def hybrid_tensors(cfg: dict, fp8: bool = False) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a Qwen3-Next or Qwen3.5/3.6-MoE checkpoint, as TENSORS.md
    lists them: Qwen3.5 with its `model.language_model.` prefix, fused 3-D experts, F32 A_log and
    DeltaNet norm, vision tower; both with the MTP layer (per-expert)."""
    assert not fp8, "the FP8 hybrid release is not built here"
    text_only = cfg["model_type"] == "qwen3_5_moe_text"  # a Qwen3_5MoeForCausalLM save: no vision, no MTP
    qwen35 = cfg["model_type"] == "qwen3_5_moe" or text_only
    t = cfg.get("text_config", cfg)
    h, inter, n_exp, v = t["hidden_size"], t["moe_intermediate_size"], t["num_experts"], t["vocab_size"]
    heads, kv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    hk, hv, dk, dv = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"]
    shared, conv_k = t["shared_expert_intermediate_size"], t["linear_conv_kernel_dim"]
    every = t.get("full_attention_interval", 4)
    types = t.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                     for i in range(t["num_hidden_layers"])]
    f32 = "F32" if qwen35 else "BF16"
    prefix = "model.language_model." if qwen35 and not text_only else "model."
    out = [(prefix + "embed_tokens.weight", "BF16", [v, h]), (prefix + "norm.weight", "BF16", [h]),
           ("lm_head.weight", "BF16", [v, h])]

    def attention(p):
        return [(p + "self_attn.q_proj.weight", "BF16", [2 * heads * hd, h]),
                (p + "self_attn.k_proj.weight", "BF16", [kv * hd, h]), (p + "self_attn.v_proj.weight", "BF16", [kv * hd, h]),
                (p + "self_attn.o_proj.weight", "BF16", [h, heads * hd]),
                (p + "self_attn.q_norm.weight", "BF16", [hd]), (p + "self_attn.k_norm.weight", "BF16", [hd])]

    def moe(p, fused):
        rows = [(p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h]),
                (p + "mlp.gate.weight", "BF16", [n_exp, h]), (p + "mlp.shared_expert_gate.weight", "BF16", [1, h]),
                (p + "mlp.shared_expert.gate_proj.weight", "BF16", [shared, h]),
                (p + "mlp.shared_expert.up_proj.weight", "BF16", [shared, h]),
                (p + "mlp.shared_expert.down_proj.weight", "BF16", [h, shared])]
        if fused:
            return rows + [(p + "mlp.experts.gate_up_proj", "BF16", [n_exp, 2 * inter, h]),
                           (p + "mlp.experts.down_proj", "BF16", [n_exp, h, inter])]
        for e in range(n_exp):
            q = f"{p}mlp.experts.{e}."
            rows += [(q + "gate_proj.weight", "BF16", [inter, h]), (q + "up_proj.weight", "BF16", [inter, h]),
                     (q + "down_proj.weight", "BF16", [h, inter])]
        return rows

    channels = 2 * hk * dk + hv * dv
    for i, kind in enumerate(types):
        p = f"{prefix}layers.{i}."
        if kind == "full_attention":
            out += attention(p)
        else:
            la = p + "linear_attn."
            if qwen35:
                out += [(la + "in_proj_qkv.weight", "BF16", [channels, h]), (la + "in_proj_z.weight", "BF16", [hv * dv, h]),
                        (la + "in_proj_b.weight", "BF16", [hv, h]), (la + "in_proj_a.weight", "BF16", [hv, h])]
            else:
                out += [(la + "in_proj_qkvz.weight", "BF16", [2 * hk * dk + 2 * hv * dv, h]),
                        (la + "in_proj_ba.weight", "BF16", [2 * hv, h])]
            out += [(la + "conv1d.weight", "BF16", [channels, 1, conv_k]), (la + "A_log", f32, [hv]),
                    (la + "dt_bias", "BF16", [hv]), (la + "norm.weight", f32, [dv]),
                    (la + "out_proj.weight", "BF16", [h, hv * dv])]
        out += moe(p, fused=qwen35)
    if text_only:
        return out
    out += [("mtp.fc.weight", "BF16", [h, 2 * h]), ("mtp.norm.weight", "BF16", [h]),
            ("mtp.pre_fc_norm_embedding.weight", "BF16", [h]), ("mtp.pre_fc_norm_hidden.weight", "BF16", [h])]
    out += attention("mtp.layers.0.") + moe("mtp.layers.0.", fused=False)
    if qwen35:
        vis = cfg["vision_config"]
        vh, vi, depth = vis["hidden_size"], vis["intermediate_size"], vis["depth"]
        out += [("model.visual.patch_embed.proj.weight", "BF16", [vh, 3, 2, 16, 16]),
                ("model.visual.patch_embed.proj.bias", "BF16", [vh]),
                ("model.visual.pos_embed.weight", "BF16", [vis.get("num_position_embeddings", 2304), vh])]
        for b in range(depth):
            q = f"model.visual.blocks.{b}."
            out += [(q + "norm1.weight", "BF16", [vh]), (q + "norm1.bias", "BF16", [vh]), (q + "norm2.weight", "BF16", [vh]),
                    (q + "norm2.bias", "BF16", [vh]), (q + "attn.qkv.weight", "BF16", [3 * vh, vh]),
                    (q + "attn.qkv.bias", "BF16", [3 * vh]), (q + "attn.proj.weight", "BF16", [vh, vh]),
                    (q + "attn.proj.bias", "BF16", [vh]), (q + "mlp.linear_fc1.weight", "BF16", [vi, vh]),
                    (q + "mlp.linear_fc1.bias", "BF16", [vi]), (q + "mlp.linear_fc2.weight", "BF16", [vh, vi]),
                    (q + "mlp.linear_fc2.bias", "BF16", [vh])]
        merged = 4 * vh
        out += [("model.visual.merger.norm.weight", "BF16", [vh]), ("model.visual.merger.norm.bias", "BF16", [vh]),
                ("model.visual.merger.linear_fc1.weight", "BF16", [merged, merged]),
                ("model.visual.merger.linear_fc1.bias", "BF16", [merged]),
                ("model.visual.merger.linear_fc2.weight", "BF16", [h, merged]),
                ("model.visual.merger.linear_fc2.bias", "BF16", [h])]
    return out


def decoder_tensors(cfg: dict, fp8: bool = False) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a Mixtral, Qwen1.5/2-MoE, OLMoE or GLM-4.5 checkpoint, as
    TENSORS.md lists them (GLM-4.5's MTP layer with the names TENSORS.md infers)."""
    assert not fp8, "no FP8 release of these families is built here"
    mt = cfg["model_type"]
    h, v, heads, kv = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    inter = cfg["intermediate_size"] if mt in ("mixtral", "olmoe") else cfg["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", "BF16", [v, h]), ("model.norm.weight", "BF16", [h]),
           ("lm_head.weight", "BF16", [v, h])]
    qkv_bias = mt == "qwen2_moe" or (mt == "glm4_moe" and cfg.get("attention_bias"))

    def layer(i: int) -> list:
        p = f"model.layers.{i}."
        rows = [(p + "self_attn.q_proj.weight", "BF16", [heads * hd, h]), (p + "self_attn.k_proj.weight", "BF16", [kv * hd, h]),
                (p + "self_attn.v_proj.weight", "BF16", [kv * hd, h]), (p + "self_attn.o_proj.weight", "BF16", [h, heads * hd]),
                (p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h])]
        if qkv_bias:
            rows += [(p + "self_attn.q_proj.bias", "BF16", [heads * hd]), (p + "self_attn.k_proj.bias", "BF16", [kv * hd]),
                     (p + "self_attn.v_proj.bias", "BF16", [kv * hd])]
        if mt == "olmoe":  # over the whole projection
            rows += [(p + "self_attn.q_norm.weight", "BF16", [heads * hd]), (p + "self_attn.k_norm.weight", "BF16", [kv * hd])]
        if mt == "glm4_moe" and i < cfg.get("first_k_dense_replace", 1):
            i2 = cfg["intermediate_size"]
            return rows + [(p + "mlp.gate_proj.weight", "BF16", [i2, h]), (p + "mlp.up_proj.weight", "BF16", [i2, h]),
                           (p + "mlp.down_proj.weight", "BF16", [h, i2])]
        if mt == "mixtral":
            rows.append((p + "block_sparse_moe.gate.weight", "BF16", [n_exp, h]))
            for e in range(n_exp):
                q = f"{p}block_sparse_moe.experts.{e}."
                rows += [(q + "w1.weight", "BF16", [inter, h]), (q + "w3.weight", "BF16", [inter, h]),
                         (q + "w2.weight", "BF16", [h, inter])]
            return rows
        rows.append((p + "mlp.gate.weight", "BF16", [n_exp, h]))
        if mt == "qwen2_moe":
            s = cfg["shared_expert_intermediate_size"]
            rows += [(p + "mlp.shared_expert_gate.weight", "BF16", [1, h]),
                     (p + "mlp.shared_expert.gate_proj.weight", "BF16", [s, h]),
                     (p + "mlp.shared_expert.up_proj.weight", "BF16", [s, h]),
                     (p + "mlp.shared_expert.down_proj.weight", "BF16", [h, s])]
        if mt == "glm4_moe":
            s = inter * cfg.get("n_shared_experts", 1)
            rows += [(p + "mlp.gate.e_score_correction_bias", "F32", [n_exp]),
                     (p + "mlp.shared_experts.gate_proj.weight", "BF16", [s, h]),
                     (p + "mlp.shared_experts.up_proj.weight", "BF16", [s, h]),
                     (p + "mlp.shared_experts.down_proj.weight", "BF16", [h, s])]
        for e in range(n_exp):
            q = f"{p}mlp.experts.{e}."
            rows += [(q + "gate_proj.weight", "BF16", [inter, h]), (q + "up_proj.weight", "BF16", [inter, h]),
                     (q + "down_proj.weight", "BF16", [h, inter])]
        return rows

    n = cfg["num_hidden_layers"]
    for i in range(n):
        out += layer(i)
    if mt == "glm4_moe":  # the MTP layer after the last
        for m in range(cfg.get("num_nextn_predict_layers", 0)):
            p = f"model.layers.{n + m}."
            out += [(p + "enorm.weight", "BF16", [h]), (p + "hnorm.weight", "BF16", [h]),
                    (p + "eh_proj.weight", "BF16", [h, 2 * h]), (p + "shared_head.norm.weight", "BF16", [h])]
            out += layer(n + m)
    return out


def deepseek_tensors(cfg: dict, fp8: bool = False) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a DeepSeek-V2/V3 or Kimi-K2 checkpoint, as TENSORS.md lists
    them: latent attention, leading dense layers, shared experts, the V3 correction bias, the MTP layers
    past num_hidden_layers; FP8 releases with a 128 x 128 block scale (F32) beside every projection but the
    router, the embeddings, the heads and eh_proj."""
    h, v, heads = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q_lora, n_exp, inter = cfg.get("q_lora_rank"), cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared = inter * cfg.get("n_shared_experts", 0)
    v3 = cfg.get("topk_method") == "noaux_tc"

    def proj(name: str, rows: int, cols: int) -> list:
        if not fp8:
            return [(name, "BF16", [rows, cols])]
        return [(name, "F8_E4M3", [rows, cols]), (name + "_scale_inv", "F32", [-(-rows // 128), -(-cols // 128)])]

    def mlp(p: str, rows: int) -> list:
        return (proj(p + "gate_proj.weight", rows, h) + proj(p + "up_proj.weight", rows, h)
                + proj(p + "down_proj.weight", h, rows))

    def layer(i: int) -> list:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if q_lora:
            rows = proj(a + "q_a_proj.weight", q_lora, h) + [(a + "q_a_layernorm.weight", "BF16", [q_lora])] + \
                proj(a + "q_b_proj.weight", heads * (nope + rope), q_lora)
        else:
            rows = proj(a + "q_proj.weight", heads * (nope + rope), h)
        rows += proj(a + "kv_a_proj_with_mqa.weight", r + rope, h) + [(a + "kv_a_layernorm.weight", "BF16", [r])]
        rows += proj(a + "kv_b_proj.weight", heads * (nope + vd), r) + proj(a + "o_proj.weight", h, heads * vd)
        rows += [(p + "input_layernorm.weight", "BF16", [h]), (p + "post_attention_layernorm.weight", "BF16", [h])]
        if i < cfg.get("first_k_dense_replace", 0):
            return rows + mlp(p + "mlp.", cfg["intermediate_size"])
        rows.append((p + "mlp.gate.weight", "BF16", [n_exp, h]))
        if v3:
            rows.append((p + "mlp.gate.e_score_correction_bias", "F32", [n_exp]))
        rows += mlp(p + "mlp.shared_experts.", shared)
        for e in range(n_exp):
            rows += mlp(f"{p}mlp.experts.{e}.", inter)
        return rows

    out = [("model.embed_tokens.weight", "BF16", [v, h]), ("model.norm.weight", "BF16", [h]),
           ("lm_head.weight", "BF16", [v, h])]
    n = cfg["num_hidden_layers"]
    for i in range(n):
        out += layer(i)
    for m in range(cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{n + m}."
        out += [(p + "embed_tokens.weight", "BF16", [v, h]), (p + "enorm.weight", "BF16", [h]),
                (p + "hnorm.weight", "BF16", [h]), (p + "eh_proj.weight", "BF16", [h, 2 * h]),
                (p + "shared_head.norm.weight", "BF16", [h]), (p + "shared_head.head.weight", "BF16", [v, h])]
        out += layer(n + m)
    return out


def gpt_oss_tensors(cfg: dict, fp8: bool = False) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor of a gpt-oss release, as TENSORS.md lists gpt-oss-20b's: MXFP4
    experts (blocks and E8M0 scales, gate and up rows interleaved), bf16 biases, sinks and the rest."""
    assert not fp8, "gpt-oss ships MXFP4"
    h, v, heads, kv, hd = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                             "head_dim"))
    e, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    out = [("model.embed_tokens.weight", "BF16", [v, h]), ("model.norm.weight", "BF16", [h]),
           ("lm_head.weight", "BF16", [v, h])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows, cols in (("q", heads * hd, h), ("k", kv * hd, h), ("v", kv * hd, h), ("o", h, heads * hd)):
            out += [(f"{p}self_attn.{name}_proj.weight", "BF16", [rows, cols]), (f"{p}self_attn.{name}_proj.bias", "BF16", [rows])]
        out += [(p + "self_attn.sinks", "BF16", [heads]), (p + "input_layernorm.weight", "BF16", [h]),
                (p + "post_attention_layernorm.weight", "BF16", [h]), (p + "mlp.router.weight", "BF16", [e, h]),
                (p + "mlp.router.bias", "BF16", [e])]
        for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            out += [(f"{p}mlp.experts.{proj}_blocks", "U8", [e, rows, cols // 32, 16]),
                    (f"{p}mlp.experts.{proj}_scales", "U8", [e, rows, cols // 32]),
                    (f"{p}mlp.experts.{proj}_bias", "BF16", [e, rows])]
    return out


def write_sparse_safetensors(path: Path, tensors: list[tuple[str, str, list[int]]]) -> None:
    """A real safetensors header followed by a hole as large as the data would be."""
    meta, at = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        n = _BYTES[dtype]
        for s in shape:
            n *= s
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + at)


def skeleton(config_name: str, out: Path, *, shard_bytes: int = 5 << 30) -> Path:
    """A sharded real-scale checkpoint from one of tests/data/configs, with its index file."""
    cfg = json.loads((CONFIGS / config_name).read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    fp8 = (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    out.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], [], 0
    tensors = {"qwen3_next": hybrid_tensors, "qwen3_5_moe": hybrid_tensors, "qwen3_5_moe_text": hybrid_tensors,
               "qwen3_moe": qwen3_moe_tensors, "deepseek_v2": deepseek_tensors, "deepseek_v3": deepseek_tensors,
               "kimi_k2": deepseek_tensors, "gpt_oss": gpt_oss_tensors}.get(cfg["model_type"], decoder_tensors)
    for t in tensors(cfg, fp8):
        n = _BYTES[t[1]]
        for s in t[2]:
            n *= s
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += n
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_sparse_safetensors(out / name, shard)
        weight_map.update({t[0]: name for t in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))




def random_qwen3_moe(path: Path, seed: int = 0, **overrides) -> Path:
    """A Qwen3-MoE checkpoint written without transformers (so golden outputs can be checked anywhere):
    HF tensor names, float32 weights with std 1/sqrt(fan_in) so activations and logit margins are O(1)."""
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu", "tie_word_embeddings": False,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "float32", **TINY, **overrides}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, _, shape in qwen3_moe_tensors(cfg, fp8=False):
        if len(shape) == 1:  # norms: around 1, not exactly, so a wrong norm shows
            tensors[name] = 1.0 + 0.1 * torch.randn(*shape, generator=g)
        else:
            fan_in = shape[1] if "embed_tokens" not in name else 10  # std 0.3: tied logits not self-dominated
            tensors[name] = torch.randn(*shape, generator=g) / fan_in ** 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_chat_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    """A real byte-level BPE tokenizer.json and a tokenizer_config.json with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def add(a, b):\n    return a + b\n" * 20, "héllo wörld, ünïcode ✓" * 10], trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                                "eos_token": "<|im_end|>"}))


def tiny_model(model_type: str, path: Path, *, fused: bool = False, seed: int = 0, **cfg) -> Path:
    """A random checkpoint of any family saved by transformers (per-expert, or with save_original_format
    False its experts fused in 3-D). Weights are drawn larger than transformers' init (std 0.2, norms and
    the router's score bias included), so logits are O(1) and far from ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg))
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.is_floating_point() and "rotary" not in name and "inv_freq" not in name:
                p.copy_(torch.randn_like(p) * (0.5 if any(s in name for s in ("norm", "A_log", "dt_bias")) else 0.2))
    model.save_pretrained(path, save_original_format=not fused)
    return Path(path)


GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def tiny_gpt_oss(path: Path, *, mxfp4: bool = True, seed: int = 0, **cfg) -> Path:
    """A random gpt-oss checkpoint saved by transformers (experts fused, gate and up interleaved, stored
    transposed [E, in, out]); with mxfp4, re-written in the release's layout: each expert projection as
    `_blocks` uint8 [E, rows, cols / 32, 16] and E8M0 `_scales` [E, rows, cols / 32] (rows as nn.Linear's:
    [E, 2I, H] and [E, H, I]), biases as they were, and quantization_config.quant_method "mxfp4"."""
    tiny_model("gpt_oss", path, seed=seed, **cfg)
    if not mxfp4:
        return Path(path)
    path = Path(path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # [E, out, in]
        planes = [quantize_mxfp4(e) for e in w]
        blocks = torch.stack([c for c, _ in planes]).view(w.shape[0], w.shape[1], -1, 16)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, torch.stack([s for _, s in planes])
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


HYBRID_BASE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_hybrid(model_type: str, out: Path, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """A random Qwen3-Next or Qwen3.5-MoE checkpoint saved by transformers, in the on-disk layout of the
    real releases: Qwen3.5 as the multimodal model (text_config, `model.language_model.` prefix, a vision
    tower) with its routed experts fused in 3-D without a `.weight` suffix; both with an `mtp.` tensor."""
    import transformers
    torch.manual_seed(seed)
    cfg = dict(HYBRID_BASE, **overrides)
    if model_type == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**cfg, partial_rotary_factor=0.25))
        prefix = "model."
    else:
        vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=cfg["hidden_size"])
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=cfg, vision_config=vision))
        prefix = "model.language_model."
    with torch.no_grad():  # larger than the default init, so logits are far from ties
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if any(s in name for s in ("norm", "A_log", "dt_bias")) else 0.2))
    model.to(dtype).save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    if model_type == "qwen3_5_moe":
        e, i = cfg["num_experts"], cfg["moe_intermediate_size"]
        for layer in range(cfg["num_hidden_layers"]):
            p = f"{prefix}layers.{layer}.mlp.experts."
            gate_up = [torch.cat([tensors.pop(f"{p}{x}.gate_proj.weight"), tensors.pop(f"{p}{x}.up_proj.weight")])
                       for x in range(e)]
            tensors[p + "gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H], gate rows first
            tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{x}.down_proj.weight") for x in range(e)])
            assert tensors[p + "gate_up_proj"].shape[1] == 2 * i
    tensors["mtp.fc.weight"] = torch.zeros(cfg["hidden_size"], 2 * cfg["hidden_size"])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out
