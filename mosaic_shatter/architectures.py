"""Per model_type: how config.json becomes an arch block, and what each tensor name is.

The arch block is the model's recipe (vault_format.md §6): every setting the runtime needs to build each
layer, spelled out, so that the runtime has no per-model settings of its own. Adding a model family is one
`Architecture` row in ARCHITECTURES: a function from config.json to the arch block (usually `decoder_arch`
with the family's facts) and one from tensor names to roles. Config fields are read in both the Hub
spelling and the transformers-5 re-serialised spelling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


class UnsupportedModel(Exception):
    """A model_type (or a feature of it) that the converter does not handle."""


@dataclass(frozen=True)
class Role:
    """What a checkpoint tensor is to the converter."""

    kind: str  # "backbone" | "expert" | "fused_gate_up" | "fused_down" | "expert_bias" | "scale" | "drop"
    layer: int | None = None
    expert: int | None = None
    projection: str | None = None  # gate | up | down for kind "expert"; gate_up | down for "expert_bias"
    part: str | None = None  # for kind == "drop": the optional part it belongs to (OPTIONAL_PARTS)
    # For fused kinds: how the experts sit in the 3-D tensor. "halves": [E, 2I, H] gate rows then up rows,
    # [E, H, I] (Qwen3.5); "interleaved": gate and up rows alternate (even gate, odd up), and a float tensor
    # is stored transposed, [E, H, 2I] and [E, I, H], while MXFP4 blocks are [E, rows, cols / 32, 16] (gpt-oss)
    fused: str = "halves"


# Parts of a checkpoint that text generation does not use; left out unless asked for (`--keep`).
OPTIONAL_PARTS = {"mtp": "MTP head", "vision": "vision tower"}


def _get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


MAX_LAYERS = 4096  # far past any checkpoint; a config's layer count sizes lists before any tensor is read


def _layers(cfg: dict) -> int:
    n = int(cfg["num_hidden_layers"])
    if not 1 <= n <= MAX_LAYERS:
        raise UnsupportedModel(f"num_hidden_layers = {n}: expected 1 to {MAX_LAYERS}")
    return n


def _rope(cfg: dict, default_partial: float = 1.0) -> dict:
    """RoPE settings from either `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = _get(params, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0))
    rope_type = params.pop("rope_type", None)
    params.pop("rope_theta", None)
    scaling = cfg.get("rope_scaling") or (params if params and rope_type not in (None, "default") else None)
    if scaling and rope_type is None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
    partial = _get(params, "partial_rotary_factor", default=_get(cfg, "partial_rotary_factor", default=default_partial))
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k not in ("partial_rotary_factor", "rope_theta", "rope_type", "type")}
    return {"theta": float(theta), "type": rope_type or "default", "scaling": scaling or None,
            "partial_rotary_factor": float(partial)}


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _sparse_kinds(cfg: dict, n_layers: int, n_experts: int) -> list[str]:
    """transformers' Qwen-MoE rule: a layer is MoE unless listed in mlp_only_layers or off the sparse step."""
    step = int(_get(cfg, "decoder_sparse_step", default=1))
    if step < 1:
        raise UnsupportedModel(f"decoder_sparse_step = {step}: expected at least 1")
    dense_only = set(_get(cfg, "mlp_only_layers", default=[]))
    return ["moe" if (i not in dense_only and n_experts > 0 and (i + 1) % step == 0) else "dense"
            for i in range(n_layers)]


def decoder_arch(cfg: dict, generation_cfg: dict | None, *, layer_kinds: list[str], layer_types: list[str],
                 num_experts: int, moe_intermediate_size: int, qk_norm: str = "none", qkv_bias: bool = False,
                 out_bias: bool = False, norm_topk_prob: bool, scoring_func: str = "softmax",
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, router_score_bias: bool = False,
                 shared_expert_intermediate_size: int = 0, shared_expert_gate: bool = False,
                 sliding_window: int | None = None, default_partial_rotary: float = 1.0, **extra) -> dict:
    """The arch block of a decoder-only MoE: what every family shares, read from config.json, plus the
    family's facts (which the family function works out from its own config keys). Every key is written,
    defaults included, so a vault says everything about how it runs (vault_format.md §6)."""
    heads = cfg["num_attention_heads"]
    gen = generation_cfg or {}
    eos = _token_ids(cfg.get("eos_token_id")) + [t for t in _token_ids(gen.get("eos_token_id"))
                                                  if t not in _token_ids(cfg.get("eos_token_id"))]
    n_layers = _layers(cfg)
    if len(layer_kinds) != n_layers or len(layer_types) != n_layers:
        raise UnsupportedModel(f"{len(layer_kinds)} layer kinds / {len(layer_types)} layer types for {n_layers} layers")
    unknown = set(layer_types) - {"full_attention", "sliding_attention", "linear_attention"}
    if unknown:
        raise UnsupportedModel(f"layer_types {sorted(unknown)} are not supported")
    if "sliding_attention" in layer_types and not sliding_window:
        raise UnsupportedModel("sliding_attention layers without a sliding_window")
    arch = {
        "model_type": cfg["model_type"],
        "architectures": list(cfg.get("architectures") or []),
        "num_hidden_layers": n_layers,
        "layer_kinds": list(layer_kinds),
        "layer_types": list(layer_types),
        "hidden_size": int(cfg["hidden_size"]),
        "intermediate_size": int(_get(cfg, "intermediate_size", default=0)),
        "moe_intermediate_size": int(moe_intermediate_size),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(_get(cfg, "num_key_value_heads", default=heads)),
        "head_dim": int(_get(cfg, "head_dim", default=cfg["hidden_size"] // heads)),
        "attention_bias": bool(qkv_bias),
        "attention_out_bias": bool(out_bias),
        "qk_norm": qk_norm,
        "clip_qkv": None,
        "attn_output_gate": False,
        "sliding_window": int(sliding_window) if sliding_window and "sliding_attention" in layer_types else None,
        "rope": _rope(cfg, default_partial_rotary),
        "max_position_embeddings": int(_get(cfg, "max_position_embeddings", default=0)),
        "rms_norm_eps": float(_get(cfg, "rms_norm_eps", default=1e-6)),
        "norm_offset": 0.0,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "num_experts": int(num_experts),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "norm_topk_prob": bool(norm_topk_prob),
        "scoring_func": scoring_func,
        "topk_method": topk_method,
        "n_group": int(n_group),
        "topk_group": int(topk_group),
        "routed_scaling_factor": float(routed_scaling_factor),
        "router_score_bias": bool(router_score_bias),
        "shared_expert_intermediate_size": int(shared_expert_intermediate_size),
        "shared_expert_gate": bool(shared_expert_gate),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": _get(cfg, "bos_token_id", default=gen.get("bos_token_id")),
        "eos_token_ids": eos,
        "pad_token_id": _get(cfg, "pad_token_id", default=gen.get("pad_token_id")),
        "source_dtype": _get(cfg, "dtype", "torch_dtype", default=None),
    }
    arch.update(extra)
    return arch


# --- qwen3_moe, qwen2_moe, olmoe, mixtral -------------------------------------------------------------
def qwen3_moe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    n_layers, n_experts = _layers(cfg), int(_get(cfg, "num_experts", "num_local_experts", default=0))
    return decoder_arch(cfg, generation_cfg, layer_kinds=_sparse_kinds(cfg, n_layers, n_experts),
                        layer_types=_attention_types(cfg, n_layers), num_experts=n_experts,
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]), qk_norm="head",
                        qkv_bias=bool(cfg.get("attention_bias", False)), out_bias=bool(cfg.get("attention_bias", False)),
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sliding_window=_window(cfg))


def qwen2_moe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """Qwen1.5-MoE and Qwen2-MoE: q/k/v biases (always, `qkv_bias` in transformers 5), a shared expert
    scaled by a sigmoid gate, softmax routing usually without renormalisation."""
    n_layers, n_experts = _layers(cfg), int(_get(cfg, "num_experts", "num_local_experts", default=0))
    return decoder_arch(cfg, generation_cfg, layer_kinds=_sparse_kinds(cfg, n_layers, n_experts),
                        layer_types=_attention_types(cfg, n_layers, qwen2_windows=True), num_experts=n_experts,
                        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                        qkv_bias=bool(cfg.get("qkv_bias", True)), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                        shared_expert_intermediate_size=int(_get(cfg, "shared_expert_intermediate_size", default=0)),
                        shared_expert_gate=True, sliding_window=_window(cfg))


def olmoe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """OLMoE: q/k RMSNorm over the whole projection (not per head), optional biases on all four projections,
    q/k/v optionally clipped."""
    n_layers, n_experts = _layers(cfg), int(_get(cfg, "num_experts", "num_local_experts"))
    bias = bool(cfg.get("attention_bias", False))
    arch = decoder_arch(cfg, generation_cfg, layer_kinds=["moe"] * n_layers,
                        layer_types=["full_attention"] * n_layers, num_experts=n_experts,
                        moe_intermediate_size=int(cfg["intermediate_size"]), qk_norm="projection", qkv_bias=bias,
                        out_bias=bias, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    arch["clip_qkv"] = float(cfg["clip_qkv"]) if cfg.get("clip_qkv") is not None else None
    return arch


def mixtral_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """Mixtral: every layer MoE, the expert width is `intermediate_size`, top-k weights always renormalised,
    a sliding window on every layer when `sliding_window` is set (it is null in the current releases)."""
    n_layers = _layers(cfg)
    window = cfg.get("sliding_window")
    return decoder_arch(cfg, generation_cfg, layer_kinds=["moe"] * n_layers,
                        layer_types=["sliding_attention" if window else "full_attention"] * n_layers,
                        num_experts=int(_get(cfg, "num_local_experts", "num_experts")),
                        moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                        sliding_window=window)


def _window(cfg: dict) -> int | None:
    return int(cfg["sliding_window"]) if cfg.get("use_sliding_window") and cfg.get("sliding_window") else None


def _attention_types(cfg: dict, n_layers: int, qwen2_windows: bool = False) -> list[str]:
    """Per layer full or sliding-window attention: the config's layer_types, else (use_sliding_window)
    transformers' rule: Qwen3-MoE windows every layer; Qwen2-MoE the even layers below max_window_layers."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != n_layers:
            raise UnsupportedModel(f"layer_types has {len(types)} entries for {n_layers} layers")
        return types
    if not _window(cfg):
        return ["full_attention"] * n_layers
    if qwen2_windows:
        limit = int(_get(cfg, "max_window_layers", default=n_layers))
        return ["sliding_attention" if (i + 1) % 2 and i < limit else "full_attention" for i in range(n_layers)]
    return ["sliding_attention"] * n_layers


_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj$")
_MIXTRAL_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2)\.weight$")
_MIXTRAL_PROJECTIONS = {"w1": "gate", "w3": "up", "w2": "down"}


def qwen3_moe_role(name: str) -> Role:
    if name.endswith("_scale_inv"):
        return Role("scale")
    if m := _EXPERT.match(name):
        return Role("expert", int(m[1]), int(m[2]), m[3])
    if m := _FUSED.match(name):
        return Role("fused_gate_up" if m[2] == "gate_up" else "fused_down", int(m[1]))
    return Role("backbone")


def mixtral_role(name: str) -> Role:
    """Mixtral's own names (block_sparse_moe.experts.E.w1/w3/w2 = gate/up/down); transformers 5 saves the
    Qwen-style names, which qwen3_moe_role reads."""
    if m := _MIXTRAL_EXPERT.match(name):
        return Role("expert", int(m[1]), int(m[2]), _MIXTRAL_PROJECTIONS[m[3]])
    return qwen3_moe_role(name)


def mixtral_backbone_name(name: str) -> str:
    """The router under transformers 5's name (mlp.gate), whichever spelling the checkpoint uses."""
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


# --- glm4_moe -------------------------------------------------------------------------------------------
def glm4_moe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """GLM-4.5 / 4.5-Air / 4.6: partial RoPE (0.5 by default), q/k/v biases, sigmoid router scores with a
    correction bias that only picks experts, group-limited top-k, a scaling factor, shared experts without
    a gate, the first `first_k_dense_replace` layers dense; an MTP layer after the last (left out)."""
    n_layers = _layers(cfg)
    dense = int(_get(cfg, "first_k_dense_replace", default=1))
    return decoder_arch(
        cfg, generation_cfg, layer_kinds=["dense" if i < dense else "moe" for i in range(n_layers)],
        layer_types=["full_attention"] * n_layers, num_experts=int(_get(cfg, "n_routed_experts", "num_local_experts")),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), qk_norm="head" if cfg.get("use_qk_norm") else "none",
        qkv_bias=bool(cfg.get("attention_bias", False)), norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        scoring_func="sigmoid", topk_method="noaux_tc", n_group=int(_get(cfg, "n_group", default=1)),
        topk_group=int(_get(cfg, "topk_group", default=1)),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", default=1.0)), router_score_bias=True,
        shared_expert_intermediate_size=int(cfg["moe_intermediate_size"]) * int(_get(cfg, "n_shared_experts", default=0)),
        default_partial_rotary=0.5)


# --- deepseek_v2, deepseek_v3, kimi_k2 (multi-head latent attention) ------------------------------------
def _deepseek_arch(cfg: dict, generation_cfg: dict | None, *, v3: bool) -> dict:
    """DeepSeek-V2 / V2-Lite, DeepSeek-V3 / R1 and Kimi-K2: multi-head latent attention (the latent_attention
    block), the first `first_k_dense_replace` layers dense then every `moe_layer_freq`-th MoE, shared experts
    without a gate, an MTP layer after the last (V3, left out). V2 routes by softmax, greedy or
    group-limited (groups ranked by their best score), its weights scaled by routed_scaling_factor, or
    renormalised instead when norm_topk_prob (as DeepSeek's own code); V3 by sigmoid with the correction
    bias and noaux_tc groups. RoPE rotates interleaved pairs in both (V3 unless `rope_interleave` is false)."""
    n_layers = _layers(cfg)
    n_experts = int(_get(cfg, "n_routed_experts", "num_local_experts", default=0))
    dense, freq = int(_get(cfg, "first_k_dense_replace", default=0)), int(_get(cfg, "moe_layer_freq", default=1))
    if freq < 1:
        raise UnsupportedModel(f"moe_layer_freq = {freq}: expected at least 1")
    if cfg.get("attention_bias"):
        raise UnsupportedModel("latent attention with attention_bias is not supported")
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if not v3 and (scoring != "softmax" or method not in ("greedy", "group_limited_greedy")):
        raise UnsupportedModel(f"DeepSeek-V2 routing by {scoring} / {method} is not supported")
    if v3 and (scoring, method) != ("sigmoid", "noaux_tc"):
        raise UnsupportedModel(f"DeepSeek-V3 routing by {scoring} / {method} is not supported")
    norm_topk = bool(cfg.get("norm_topk_prob", v3))
    scaling = float(_get(cfg, "routed_scaling_factor", default=1.0))
    if norm_topk and not v3:
        scaling = 1.0
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    arch = decoder_arch(
        {**cfg, "head_dim": nope + rope}, generation_cfg,
        layer_kinds=["moe" if n_experts and i >= dense and i % freq == 0 else "dense" for i in range(n_layers)],
        layer_types=["full_attention"] * n_layers, num_experts=n_experts,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=norm_topk, scoring_func=scoring,
        topk_method=method, n_group=int(_get(cfg, "n_group", default=1)),
        topk_group=int(_get(cfg, "topk_group", default=1)), routed_scaling_factor=scaling, router_score_bias=v3,
        shared_expert_intermediate_size=int(cfg["moe_intermediate_size"]) * int(_get(cfg, "n_shared_experts",
                                                                                     default=0)))
    arch["latent_attention"] = {
        "q_lora_rank": int(_get(cfg, "q_lora_rank", default=0)),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(cfg["v_head_dim"]),
        "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True,
    }
    return arch


def deepseek_v2_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    return _deepseek_arch(cfg, generation_cfg, v3=False)


def deepseek_v3_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    return _deepseek_arch(cfg, generation_cfg, v3=True)


# --- qwen3_next, qwen3_5_moe, qwen3_5_moe_text (hybrid: Gated DeltaNet + gated attention) --------------
def _hybrid_types(cfg: dict, n_layers: int) -> list[str]:
    """transformers' rule: the config's layer_types, else every full_attention_interval-th layer is full."""
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
        if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
            raise UnsupportedModel(f"layer_types {types} does not give one known type per layer")
        return types
    every = int(_get(cfg, "full_attention_interval", default=4))
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]


def _hybrid_arch(cfg: dict, generation_cfg: dict | None, *, model_type: str, fused_projections: bool,
                 always_moe: bool) -> dict:
    n_layers = _layers(cfg)
    n_experts = int(_get(cfg, "num_experts", default=0))
    if always_moe:  # Qwen3.5: every layer is MoE and top-k weights are always renormalised
        kinds, norm_topk = ["moe"] * n_layers, True
    else:
        kinds, norm_topk = _sparse_kinds(cfg, n_layers, n_experts), bool(cfg.get("norm_topk_prob", True))
    arch = decoder_arch(
        cfg, generation_cfg, layer_kinds=kinds, layer_types=_hybrid_types(cfg, n_layers), num_experts=n_experts,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]), qk_norm="head", norm_topk_prob=norm_topk,
        qkv_bias=bool(cfg.get("attention_bias")), out_bias=bool(cfg.get("attention_bias")),
        shared_expert_intermediate_size=int(_get(cfg, "shared_expert_intermediate_size", default=0)),
        shared_expert_gate=True, default_partial_rotary=0.25)  # transformers' default for these families
    arch.update({
        "model_type": model_type,
        "norm_offset": 1.0,  # zero-centred RMSNorm weights: x * (1 + w)
        "attn_output_gate": True,
        "linear_attention": {
            "num_key_heads": int(cfg["linear_num_key_heads"]),
            "num_value_heads": int(cfg["linear_num_value_heads"]),
            "key_head_dim": int(cfg["linear_key_head_dim"]),
            "value_head_dim": int(cfg["linear_value_head_dim"]),
            "conv_kernel": int(_get(cfg, "linear_conv_kernel_dim", default=4)),
            "projections": "fused_qkvz_ba" if fused_projections else "qkv_z_b_a",
        },
    })
    return arch


def qwen3_next_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    return _hybrid_arch(cfg, generation_cfg, model_type="qwen3_next", fused_projections=True, always_moe=False)


def qwen3_5_moe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """The multimodal checkpoint: the text model's settings sit in text_config."""
    text = dict(cfg.get("text_config") or cfg)
    for key in ("tie_word_embeddings", "architectures", "bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    text.setdefault("tie_word_embeddings", False)
    return _hybrid_arch(text, generation_cfg, model_type="qwen3_5_moe", fused_projections=False, always_moe=True)


def qwen3_5_moe_text_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """A text-only save (Qwen3_5MoeForCausalLM, often a fine-tune): the same network as qwen3_5_moe, its
    settings at the top level and its tensors under `model.`."""
    return _hybrid_arch(cfg, generation_cfg, model_type="qwen3_5_moe_text", fused_projections=False, always_moe=True)


# --- gpt_oss (attention sinks, alternating sliding windows, MXFP4 experts with biases) ------------------
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # transformers' GptOssConfig defaults (the released configs omit alpha)


def gpt_oss_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """gpt-oss-20b / 120b: every layer MoE, the expert width is `intermediate_size`; biases on q, k, v and o;
    a learned sink logit per query head; layers alternating a sliding window and full attention
    (`layer_types`); a router with a bias whose top-k logits are softmaxed (the same weights as a softmax
    over all, renormalised over the top k); experts with biases and a clamped SwiGLU."""
    n_layers = _layers(cfg)
    bias = bool(cfg.get("attention_bias", True))
    types = list(cfg.get("layer_types") or  # transformers' default: sliding windows on the even layers
                 ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)])
    if len(types) != n_layers:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {n_layers} layers")
    arch = decoder_arch(cfg, generation_cfg, layer_kinds=["moe"] * n_layers, layer_types=types,
                        num_experts=int(_get(cfg, "num_local_experts", "num_experts")),
                        moe_intermediate_size=int(cfg["intermediate_size"]), qkv_bias=bias, out_bias=bias,
                        norm_topk_prob=True, sliding_window=cfg.get("sliding_window"))
    arch.update({
        "intermediate_size": 0,  # no dense MLP: intermediate_size is the experts' width
        "hidden_act": "clamped_swiglu",
        "swiglu_alpha": float(_get(cfg, "swiglu_alpha", default=SWIGLU_ALPHA)),
        "swiglu_limit": float(_get(cfg, "swiglu_limit", default=SWIGLU_LIMIT)),
        "attention_sinks": True,
        "router_bias": True,
    })
    return arch


_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_blocks|_scales|_bias)?$")


def gpt_oss_role(name: str) -> Role:
    """Experts fused per layer, gate and up interleaved: bf16 `gate_up_proj` [E, H, 2I] (transposed) or MXFP4
    `gate_up_proj_blocks` / `_scales`; biases `gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H]."""
    if m := _GPT_OSS_EXPERTS.match(name):
        layer, proj, suffix = int(m[1]), m[2], m[3]
        if suffix == "_scales":
            return Role("scale")
        if suffix == "_bias":
            return Role("expert_bias", layer, projection=proj)
        return Role("fused_gate_up" if proj == "gate_up" else "fused_down", layer, fused="interleaved")
    return Role("backbone")


def qwen3_next_role(name: str) -> Role:
    if name.startswith("mtp."):
        return Role("drop", part="mtp")  # the multi-token-prediction head: text generation does not use it
    return qwen3_moe_role(name)


_TEXT_PREFIX = "model.language_model."


def qwen3_5_moe_role(name: str) -> Role:
    if name.startswith("mtp."):
        return Role("drop", part="mtp")
    if name.startswith("model.visual."):
        return Role("drop", part="vision")  # text-only by default
    if name.startswith(_TEXT_PREFIX):
        name = "model." + name[len(_TEXT_PREFIX):]
    return qwen3_moe_role(name)


def qwen3_5_moe_backbone_name(name: str) -> str:
    """The text model's own names (transformers' Qwen3_5MoeForCausalLM), without the multimodal prefix."""
    return "model." + name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name


@dataclass(frozen=True)
class Architecture:
    model_type: str
    arch_block: Callable[[dict, dict | None], dict]  # (config, generation_config) -> arch block
    role: Callable[[str], Role]  # tensor name -> what it is
    backbone_name: Callable[[str], str] = lambda name: name  # source name -> name in backbone.safetensors


ARCHITECTURES = {
    "qwen3_moe": Architecture("qwen3_moe", qwen3_moe_arch, qwen3_moe_role),
    "qwen2_moe": Architecture("qwen2_moe", qwen2_moe_arch, qwen3_moe_role),
    "olmoe": Architecture("olmoe", olmoe_arch, qwen3_moe_role),
    "mixtral": Architecture("mixtral", mixtral_arch, mixtral_role, mixtral_backbone_name),
    "glm4_moe": Architecture("glm4_moe", glm4_moe_arch, qwen3_moe_role),
    "deepseek_v2": Architecture("deepseek_v2", deepseek_v2_arch, qwen3_moe_role),
    "deepseek_v3": Architecture("deepseek_v3", deepseek_v3_arch, qwen3_moe_role),
    "kimi_k2": Architecture("kimi_k2", deepseek_v3_arch, qwen3_moe_role),  # DeepseekV3ForCausalLM
    "qwen3_next": Architecture("qwen3_next", qwen3_next_arch, qwen3_next_role),
    "qwen3_5_moe": Architecture("qwen3_5_moe", qwen3_5_moe_arch, qwen3_5_moe_role, qwen3_5_moe_backbone_name),
    "qwen3_5_moe_text": Architecture("qwen3_5_moe_text", qwen3_5_moe_text_arch, qwen3_next_role),
    "gpt_oss": Architecture("gpt_oss", gpt_oss_arch, gpt_oss_role),
}


def architecture_for(config: dict) -> Architecture:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]
