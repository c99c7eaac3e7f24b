"""Layer recipes: what each layer of a model is made of, read from the vault's arch block.

The arch block spells out every setting (vault_format.md §6), so one reader turns any family's block into
a ModelRecipe: per layer a token mixer (attention in its variants, or Gated DeltaNet) and an FFN (routed
experts with their router, optional shared expert, or a dense MLP). The torch reference (decoder.py) and
the native decode step (native_step.py) both interpret recipes; neither knows model families.

Every key the converter writes is read here. A key this runtime does not know, holding anything but a
null, false, zero or empty value, refuses the model: it would otherwise run silently wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class QkNorm(str, Enum):
    NONE = "none"
    HEAD = "head"  # RMSNorm over each head's head_dim values (Qwen3, GLM-4.5 with use_qk_norm)
    PROJECTION = "projection"  # RMSNorm over the whole q (or k) projection (OLMoE)


class Scoring(str, Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class Activation(str, Enum):
    SILU = "silu"  # silu(gate) * up
    CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss: (clamp(up, +-limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)


@dataclass(frozen=True)
class ExpertActivation:
    """How a routed expert joins its gate and up projections."""

    kind: Activation = Activation.SILU
    alpha: float = 1.0
    limit: float = 0.0


class TopkMethod(str, Enum):
    GREEDY = "greedy"  # top-k over all experts
    GROUP_LIMITED = "group_limited_greedy"  # DeepSeek-V2: groups ranked by their best score
    NOAUX_TC = "noaux_tc"  # DeepSeek-V3, GLM-4.5: groups ranked by the sum of their top-2 biased scores


@dataclass(frozen=True)
class Rope:
    theta: float
    rot_dim: int  # the leading values of each head that rotate (partial RoPE)
    kind: str  # default | linear | yarn | llama3
    scaling: dict | None  # the kind's parameters, as config.json gives them
    max_position_embeddings: int  # YaRN and llama3 fall back to it for original_max_position_embeddings


class CacheGeometry(NamedTuple):
    """What an attention layer keeps in the KV cache a position."""

    heads: int
    dim: int  # values a head
    shared: bool  # one row is key and value (a latent cache)


@dataclass(frozen=True)
class Attention:
    """Softmax attention over a KV cache: GQA / MQA / MHA."""

    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: QkNorm
    qkv_bias: bool
    o_bias: bool
    output_gate: bool  # q_proj yields per head a query then a gate; sigmoid(gate) scales the output
    sliding_window: int | None  # attend to the last `sliding_window` positions (this one included)
    clip_qkv: float | None  # q, k, v clamped to +-clip_qkv after their norms
    rope: Rope
    sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def cache_geometry(self) -> CacheGeometry:
        return CacheGeometry(self.kv_heads, self.head_dim, shared=False)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2). Keys and values of every head come from one
    latent per token: kv_lora_rank normed values and a shared rope key of rope_dim, which is all the KV
    cache holds. The query is q_proj (q_lora_rank 0) or q_b_proj(norm(q_a_proj)); per head its first
    nope_dim values meet the latent through kv_b_proj's key rows, its last rope_dim the rope key."""

    heads: int
    q_lora_rank: int  # 0: a plain q_proj
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    rope_interleave: bool  # the checkpoint's rope rows rotate in adjacent pairs: permuted at load to halves
    scale: float  # softmax scale: (nope_dim + rope_dim) ** -0.5, times YaRN's mscale(mscale_all_dim) squared
    rope: Rope

    @property
    def latent_dim(self) -> int:
        """Values a token a layer in the KV cache."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def cache_geometry(self) -> CacheGeometry:
        return CacheGeometry(1, self.latent_dim, shared=True)  # one latent row a position


@dataclass(frozen=True)
class DeltaNet:
    """Gated DeltaNet: linear attention with a constant-size state (models/delta_rule.py)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba, un-fused at load

    @property
    def channels(self) -> int:
        """Width of the causal conv: q and k of every key head, v of every value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


@dataclass(frozen=True)
class Router:
    experts: int
    top_k: int
    scoring: Scoring
    norm_topk_prob: bool  # renormalise the chosen weights to sum to 1
    method: TopkMethod
    n_group: int
    topk_group: int
    scaling: float  # routed_scaling_factor, times the final weights
    score_bias: bool  # e_score_correction_bias: added to the scores to choose, not to weigh
    logit_bias: bool = False  # the router is a Linear with a bias (gpt-oss)


@dataclass(frozen=True)
class Ffn:
    """Routed experts (router set) with an optional shared expert, or a dense MLP (router None)."""

    router: Router | None
    intermediate: int  # the dense MLP's width, or the shared expert's (0: none)
    shared_gate: bool  # the shared expert's output is scaled by sigmoid(x @ shared_expert_gate.T)


@dataclass(frozen=True)
class LayerRecipe:
    mixer: Attention | LatentAttention | DeltaNet
    ffn: Ffn


@dataclass(frozen=True)
class ModelRecipe:
    model_type: str
    hidden: int
    vocab: int
    eps: float
    norm_offset: float  # 1.0: RMSNorm weights are zero-centred (x * (1 + w)), the DeltaNet output norm excepted
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    layers: tuple[LayerRecipe, ...]
    expert_activation: ExpertActivation = ExpertActivation()

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a KV cache: softmax attention, latent or not."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, (Attention, LatentAttention))]

    @property
    def delta_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, DeltaNet)]

    @property
    def attention(self) -> Attention | LatentAttention | None:
        """The attention geometry every attention layer shares (the KV cache's, the RoPE's), None if there
        is none."""
        att = [self.layers[i].mixer for i in self.attention_layers]
        return att[0] if att else None

    @property
    def top_k(self) -> int:
        return max((layer.ffn.router.top_k for layer in self.layers if layer.ffn.router), default=0)


# Keys that describe the source and change nothing in the computation.
INFORMATIONAL = ("architectures", "bos_token_id", "pad_token_id", "source_dtype")
SUPPORTED_ROPE = ("default", "linear", "yarn", "llama3")


class ArchReader:
    """The arch block, with a note of every key read, so unread keys can be refused at the end."""

    def __init__(self, arch: dict):
        self.arch, self.read = arch, set()

    def __getitem__(self, key: str):
        self.read.add(key)
        return self.arch[key]

    def get(self, key: str, default=None):
        self.read.add(key)
        value = self.arch.get(key)
        return default if value is None else value

    def check_all_read(self) -> None:
        unread = {k: v for k, v in self.arch.items() if k not in self.read and v not in (None, False, 0, [], {}, "")}
        if unread:
            raise NotImplementedError("this runtime does not know the arch block's "
                                      + ", ".join(f"{k} = {v!r}" for k, v in sorted(unread.items()))
                                      + " (a vault from a newer converter?)")


def _qk_norm(value) -> QkNorm:
    if isinstance(value, bool):  # vaults written before qk_norm had its own values: per head when true
        return QkNorm.HEAD if value else QkNorm.NONE
    return _enum(QkNorm, value, "qk_norm")


def _enum(kind, value, key: str):
    try:
        return kind(value)
    except ValueError:
        raise NotImplementedError(f"arch {key} = {value!r} is not supported "
                                  f"({', '.join(k.value for k in kind)})") from None


def read_recipe(arch: dict) -> ModelRecipe:
    """The recipe of a vault's arch block.

    Raises:
        NotImplementedError: a setting this runtime cannot run (named, with its value), or a block that is
            not one at all (a key missing from a nested object, a value of the wrong type: a damaged vault).
    """
    try:
        return _read_recipe(arch)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        what = f"{e} is missing" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise NotImplementedError(f"the arch block is not one this runtime reads ({what})") from None


def _read_recipe(arch: dict) -> ModelRecipe:
    a = ArchReader(arch)
    for key in INFORMATIONAL:
        a.get(key)
    activation = _enum(Activation, a.get("hidden_act", "silu"), "hidden_act")
    expert_activation = ExpertActivation(activation)
    if activation is Activation.CLAMPED_SWIGLU:
        expert_activation = ExpertActivation(activation, float(a["swiglu_alpha"]), float(a["swiglu_limit"]))
    n = a["num_hidden_layers"]
    kinds, types = a["layer_kinds"], a.get("layer_types") or ["full_attention"] * n
    if len(kinds) != n or len(types) != n:
        raise NotImplementedError(f"{len(kinds)} layer kinds and {len(types)} layer types for {n} layers")
    rope = a["rope"]
    rope_kind = rope.get("type", "default")
    if rope_kind not in SUPPORTED_ROPE:
        raise NotImplementedError(f"rope type {rope_kind!r} is not supported ({', '.join(SUPPORTED_ROPE)})")
    head_dim = a["head_dim"]
    rot_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise NotImplementedError(f"a rotary width of {rot_dim} of head_dim {head_dim} is not supported")
    window = a.get("sliding_window")
    attention = dict(
        heads=a["num_attention_heads"], kv_heads=a["num_key_value_heads"], head_dim=head_dim,
        qk_norm=_qk_norm(a.get("qk_norm", False)), qkv_bias=bool(a.get("attention_bias")),
        o_bias=bool(a.get("attention_out_bias")), output_gate=bool(a.get("attn_output_gate")),
        clip_qkv=a.get("clip_qkv"), sinks=bool(a.get("attention_sinks")),
        rope=Rope(float(rope["theta"]), rot_dim, rope_kind, rope.get("scaling"), a.get("max_position_embeddings", 0)))
    if attention["heads"] % attention["kv_heads"]:
        raise NotImplementedError(f"{attention['heads']} query heads do not share {attention['kv_heads']} KV heads evenly")
    latent = _latent_attention(a.get("latent_attention"), attention) if a.get("latent_attention") else None
    la = a.get("linear_attention")
    delta = None
    if la:
        delta = DeltaNet(la["num_key_heads"], la["num_value_heads"], la["key_head_dim"], la["value_head_dim"],
                         la["conv_kernel"], _projections(la.get("projections", "qkv_z_b_a")))
        if delta.value_heads % delta.key_heads:
            raise NotImplementedError("Gated DeltaNet value heads must be a multiple of its key heads")
    router = Router(
        experts=a["num_experts"], top_k=a["num_experts_per_tok"], scoring=_enum(Scoring, a["scoring_func"], "scoring_func"),
        norm_topk_prob=bool(a["norm_topk_prob"]), method=_enum(TopkMethod, a.get("topk_method", "greedy"), "topk_method"),
        n_group=a.get("n_group", 1), topk_group=a.get("topk_group", 1), scaling=float(a.get("routed_scaling_factor", 1.0)),
        score_bias=bool(a.get("router_score_bias")), logit_bias=bool(a.get("router_bias")))
    if router.experts % router.n_group or router.topk_group > router.n_group:
        raise NotImplementedError(f"{router.experts} experts in {router.n_group} groups, top {router.topk_group} groups")
    if router.top_k > 64:
        raise NotImplementedError(f"top-{router.top_k} routing is not supported (at most 64)")
    a["moe_intermediate_size"]  # the vault's record geometry: read by the vault itself
    shared, shared_gate = a["shared_expert_intermediate_size"], bool(a.get("shared_expert_gate"))
    dense = a.get("intermediate_size", 0)

    layers = []
    for i, (kind, mixer_type) in enumerate(zip(kinds, types)):
        if mixer_type == "linear_attention":
            if delta is None:
                raise NotImplementedError(f"layer {i} is linear attention, but the arch block has no linear_attention")
            mixer = delta
        elif mixer_type in ("full_attention", "sliding_attention"):
            if mixer_type == "sliding_attention" and not window:
                raise NotImplementedError(f"layer {i} is sliding-window attention without a sliding_window")
            if latent is not None:
                if mixer_type == "sliding_attention":
                    raise NotImplementedError(f"layer {i}: latent attention over a sliding window is not supported")
                mixer = latent
            else:
                mixer = Attention(sliding_window=window if mixer_type == "sliding_attention" else None, **attention)
        else:
            raise NotImplementedError(f"layer {i}: layer type {mixer_type!r} is not supported")
        if kind == "moe":
            ffn = Ffn(router, shared, shared_gate and shared > 0)
        elif kind == "dense":
            ffn = Ffn(None, dense, False)
        else:
            raise NotImplementedError(f"layer {i}: layer kind {kind!r} is not supported")
        layers.append(LayerRecipe(mixer, ffn))
    recipe = ModelRecipe(
        model_type=a["model_type"], hidden=a["hidden_size"], vocab=a["vocab_size"], eps=float(a["rms_norm_eps"]),
        norm_offset=float(a.get("norm_offset", 0.0)), tie_word_embeddings=bool(a["tie_word_embeddings"]),
        eos_token_ids=tuple(a.get("eos_token_ids") or ()), layers=tuple(layers), expert_activation=expert_activation)
    a.check_all_read()
    return recipe


def _latent_attention(mla: dict, attention: dict) -> LatentAttention:
    """The latent-attention block; its rope is the attention's, rotating the rope_dim values. The softmax
    scale follows DeepSeek: under a scaled RoPE with mscale_all_dim, times mscale(factor, mscale_all_dim)^2."""
    if attention["qkv_bias"] or attention["o_bias"] or attention["sinks"]:
        raise NotImplementedError("latent attention with projection biases or attention sinks is not supported")
    nope, rope_dim = int(mla["qk_nope_head_dim"]), int(mla["qk_rope_head_dim"])
    if rope_dim % 2 or rope_dim <= 0:
        raise NotImplementedError(f"a rotary width of {rope_dim} is not supported")
    rope = attention["rope"]
    rope = Rope(rope.theta, rope_dim, rope.kind, rope.scaling, rope.max_position_embeddings)
    scale = (nope + rope_dim) ** -0.5
    s = rope.scaling or {}
    if rope.kind != "default" and s.get("mscale_all_dim"):
        factor = float(s["factor"])
        m = 0.1 * float(s["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= m * m
    return LatentAttention(heads=attention["heads"], q_lora_rank=int(mla.get("q_lora_rank") or 0),
                           kv_lora_rank=int(mla["kv_lora_rank"]), nope_dim=nope, rope_dim=rope_dim,
                           v_dim=int(mla["v_head_dim"]), rope_interleave=bool(mla.get("rope_interleave")),
                           scale=scale, rope=rope)


def _projections(value: str) -> bool:
    if value not in ("fused_qkvz_ba", "qkv_z_b_a"):
        raise NotImplementedError(f"linear_attention projections {value!r} are not supported")
    return value == "fused_qkvz_ba"
