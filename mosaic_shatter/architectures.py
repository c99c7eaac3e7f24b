"""Per model_type: how config.json becomes an arch block, and what each tensor name is.

Adding a model family is one `Architecture` entry in ARCHITECTURES (plus its runtime model file).
Config fields are read in both the Hub spelling and the transformers-5 re-serialised spelling.
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

    kind: str  # "backbone" | "expert" | "fused_gate_up" | "fused_down" | "scale" | "drop"
    layer: int | None = None
    expert: int | None = None
    projection: str | None = None  # gate | up | down, for kind == "expert"
    part: str | None = None  # for kind == "drop": the optional part it belongs to (OPTIONAL_PARTS)


# Parts of a checkpoint that text generation does not use; left out unless asked for (`--keep`).
OPTIONAL_PARTS = {"mtp": "MTP head", "vision": "vision tower"}


def _get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def _rope(cfg: dict) -> dict:
    """RoPE settings from either `rope_theta` + `rope_scaling` or transformers-5 `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = _get(params, "rope_theta", default=_get(cfg, "rope_theta", default=10000.0))
    rope_type = params.pop("rope_type", None)
    params.pop("rope_theta", None)
    scaling = cfg.get("rope_scaling") or (params if params and rope_type not in (None, "default") else None)
    if scaling and rope_type is None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
    partial = _get(params, "partial_rotary_factor", default=_get(cfg, "partial_rotary_factor", default=1.0))
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k not in ("partial_rotary_factor", "rope_theta")}
    return {"theta": float(theta), "type": rope_type or "default", "scaling": scaling or None,
            "partial_rotary_factor": float(partial)}


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def common_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    """Fields every decoder-only family shares, spelled as the arch block spells them."""
    heads = cfg["num_attention_heads"]
    gen = generation_cfg or {}
    eos = _token_ids(cfg.get("eos_token_id")) + [t for t in _token_ids(gen.get("eos_token_id"))
                                                  if t not in _token_ids(cfg.get("eos_token_id"))]
    return {
        "model_type": cfg["model_type"],
        "architectures": list(cfg.get("architectures") or []),
        "num_hidden_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(_get(cfg, "num_key_value_heads", default=heads)),
        "head_dim": int(_get(cfg, "head_dim", default=cfg["hidden_size"] // heads)),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "rope": _rope(cfg),
        "max_position_embeddings": int(_get(cfg, "max_position_embeddings", default=0)),
        "rms_norm_eps": float(_get(cfg, "rms_norm_eps", default=1e-6)),
        "hidden_act": cfg.get("hidden_act", "silu"),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "bos_token_id": _get(cfg, "bos_token_id", default=gen.get("bos_token_id")),
        "eos_token_ids": eos,
        "pad_token_id": _get(cfg, "pad_token_id", default=gen.get("pad_token_id")),
        "sliding_window": cfg.get("sliding_window") if cfg.get("use_sliding_window") else None,
        "source_dtype": _get(cfg, "dtype", "torch_dtype", default=None),
    }


# --- qwen3_moe ----------------------------------------------------------------------------------
def qwen3_moe_arch(cfg: dict, generation_cfg: dict | None) -> dict:
    n_layers = int(cfg["num_hidden_layers"])
    n_experts = int(_get(cfg, "num_experts", "num_local_experts", default=0))
    step = int(_get(cfg, "decoder_sparse_step", default=1))
    dense_only = set(_get(cfg, "mlp_only_layers", default=[]))
    # Same rule as transformers' Qwen3MoeDecoderLayer.
    kinds = ["moe" if (i not in dense_only and n_experts > 0 and (i + 1) % step == 0) else "dense"
             for i in range(n_layers)]
    arch = common_arch(cfg, generation_cfg)
    arch.update({
        "layer_kinds": kinds,
        "layer_types": ["full_attention"] * n_layers,
        "qk_norm": True,
        "intermediate_size": int(cfg["intermediate_size"]),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "num_experts": n_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "scoring_func": "softmax",
        "shared_expert_intermediate_size": 0,
    })
    return arch


_QWEN3_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_QWEN3_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj$")


def qwen3_moe_role(name: str) -> Role:
    if name.endswith("_scale_inv"):
        return Role("scale")
    if m := _QWEN3_EXPERT.match(name):
        return Role("expert", int(m[1]), int(m[2]), m[3])
    if m := _QWEN3_FUSED.match(name):
        return Role("fused_gate_up" if m[2] == "gate_up" else "fused_down", int(m[1]))
    return Role("backbone")


# --- qwen3_next and qwen3_5_moe (hybrid: Gated DeltaNet + gated attention, shared experts) --------
def _layer_types(cfg: dict, n_layers: int) -> list[str]:
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
    n_layers = int(cfg["num_hidden_layers"])
    n_experts = int(_get(cfg, "num_experts", default=0))
    if always_moe:  # Qwen3.5: every layer is MoE and top-k weights are always renormalised
        kinds, norm_topk = ["moe"] * n_layers, True
    else:
        step = int(_get(cfg, "decoder_sparse_step", default=1))
        dense_only = set(_get(cfg, "mlp_only_layers", default=[]))
        kinds = ["moe" if (i not in dense_only and n_experts > 0 and (i + 1) % step == 0) else "dense"
                 for i in range(n_layers)]
        norm_topk = bool(cfg.get("norm_topk_prob", True))
    arch = common_arch(cfg, generation_cfg)
    if "partial_rotary_factor" not in (cfg.get("rope_parameters") or {}) and "partial_rotary_factor" not in cfg:
        arch["rope"]["partial_rotary_factor"] = 0.25  # transformers' default for both families
    arch.update({
        "model_type": model_type,
        "layer_kinds": kinds,
        "layer_types": _layer_types(cfg, n_layers),
        "qk_norm": True,
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
        "intermediate_size": int(_get(cfg, "intermediate_size", default=0)),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "num_experts": n_experts,
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "norm_topk_prob": norm_topk,
        "scoring_func": "softmax",
        "shared_expert_intermediate_size": int(_get(cfg, "shared_expert_intermediate_size", default=0)),
        "shared_expert_gate": True,
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
    "qwen3_next": Architecture("qwen3_next", qwen3_next_arch, qwen3_next_role),
    "qwen3_5_moe": Architecture("qwen3_5_moe", qwen3_5_moe_arch, qwen3_5_moe_role, qwen3_5_moe_backbone_name),
}


def architecture_for(config: dict) -> Architecture:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]
