"""The backbone as a model holds it: per layer, the tensors its recipe needs, found by the family's names.

Matrices stay as stored (bf16, or quantised at load: backbone.QuantizedMatrix, Q4Matrix) for ops.linear and
the native kernels; vectors (norms, biases, the DeltaNet's decay terms) become float32 once, here, with a
zero-centred norm's offset already added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Union

import torch

from ..backbone import Q4Matrix, QuantizedMatrix, quantize_matrix
from .families import WeightNames
from ..recipe import Attention, DeltaNet, LatentAttention, ModelRecipe, QkNorm

Matrix = Union[torch.Tensor, QuantizedMatrix, Q4Matrix]  # [out, in]


@dataclass
class AttentionWeights:
    q: Matrix  # [heads * D, H]; with an output gate [heads * 2D, H]: per head, query then gate
    k: Matrix  # [kv_heads * D, H]
    v: Matrix  # [kv_heads * D, H]
    o: Matrix  # [H, heads * D]
    q_bias: torch.Tensor | None  # [rows of q]
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None  # [H]
    q_norm: torch.Tensor | None  # [D] per head, or [heads * D] over the projection
    k_norm: torch.Tensor | None
    sinks: torch.Tensor | None = None  # [heads]: a logit each query head's softmax adds to its denominator


@dataclass
class LatentWeights:
    q: Matrix | None  # [heads * (nope + rope), H] when q_lora_rank is 0; per head its nope values, then rope
    q_a: Matrix | None  # [q_lora_rank, H]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Matrix | None  # [heads * (nope + rope), q_lora_rank]
    kv_a: Matrix  # [kv_lora_rank + rope, H]: the latent, then the shared rope key
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    # kv_b_proj [heads * (nope + v), kv_lora_rank] (per head its key rows, then its value rows) as the two
    # halves the absorbed attention multiplies by (split_latent_kv):
    uk_t: Matrix  # [heads * kv_lora_rank, nope]: each head's key rows, transposed
    uv: Matrix  # [heads * v, kv_lora_rank]: each head's value rows
    o: Matrix  # [H, heads * v]


@dataclass
class DeltaNetWeights:
    qkv: Matrix  # [2*Hk*dk + Hv*dv, H]: q heads, k heads, v heads (the conv's channel order)
    z: Matrix  # [Hv*dv, H] output gate
    b: Matrix  # [Hv, H] -> beta
    a: Matrix  # [Hv, H] -> decay
    conv: torch.Tensor  # [C, K] depthwise taps; [:, K-1] multiplies the current token
    neg_decay: torch.Tensor  # [Hv]: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [dv], plain w * x (not zero-centred)
    out: Matrix  # [H, Hv*dv]


@dataclass
class FfnWeights:
    router: Matrix | None  # [E, H]
    router_bias: torch.Tensor | None  # [E] score correction bias
    router_logit_bias: torch.Tensor | None  # [E] the router Linear's own bias
    gate: Matrix | None  # the dense MLP's or the shared expert's [I, H]
    up: Matrix | None  # [I, H]
    down: Matrix | None  # [H, I]
    shared_gate: Matrix | None  # [1, H]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    mixer: AttentionWeights | LatentWeights | DeltaNetWeights
    ffn: FfnWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: Matrix  # [V, H]; the embedding itself when tied (unless quantised at load: backbone.py)
    layers: list[LayerWeights]


class _Tensors:
    def __init__(self, tensors: Mapping[str, Matrix], dtype: torch.dtype, offset: float):
        self.tensors, self.dtype, self.offset = tensors, dtype, offset

    def matrix(self, name: str) -> Matrix:
        if name not in self.tensors:
            raise NotImplementedError(f"the backbone has no {name}, which the arch block's recipe needs")
        return self.tensors[name]

    def vector(self, name: str) -> torch.Tensor:
        return self.matrix(name).to(self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        """A norm's weight as it multiplies: w, or 1 + w for zero-centred norms."""
        return self.offset + self.vector(name)

    def optional(self, name: str, present: bool) -> torch.Tensor | None:
        return self.vector(name) if present else None


def load_weights(recipe: ModelRecipe, names: WeightNames, tensors: Mapping[str, Matrix],
                 dtype: torch.dtype = torch.float32) -> ModelWeights:
    """Every tensor the recipe needs, by the family's names.

    Raises:
        NotImplementedError: a tensor the recipe needs is not in the backbone.
    """
    t = _Tensors(tensors, dtype, recipe.norm_offset)
    embed = t.matrix(names.embed)
    lm_head = tensors.get(names.lm_head)
    if lm_head is None:
        if not recipe.tie_word_embeddings:
            raise NotImplementedError(f"the backbone has no {names.lm_head} and the embeddings are not tied")
        lm_head = embed
    layers = []
    for i, layer in enumerate(recipe.layers):
        of = lambda name: names.of(i, name)  # noqa: E731
        if isinstance(layer.mixer, Attention):
            mixer = _attention(t, of, names.attention, layer.mixer, names.sinks)
        elif isinstance(layer.mixer, LatentAttention):
            mixer = _latent(t, of, names.attention, layer.mixer)
        else:
            mixer = _delta_net(t, of, names.delta_net, layer.mixer)
        ffn = layer.ffn
        mlp = names.shared_expert if ffn.router else names.dense_mlp
        gate, up, down = ((t.matrix(of(f"{mlp}{p}_proj.weight")) for p in ("gate", "up", "down"))
                          if ffn.intermediate else (None, None, None))
        layers.append(LayerWeights(
            t.norm(of(names.input_norm)), t.norm(of(names.post_norm)), mixer,
            FfnWeights(t.matrix(of(names.router)) if ffn.router else None,
                       t.vector(of(names.router_bias)) if ffn.router and ffn.router.score_bias else None,
                       t.vector(of(names.router_logit_bias)) if ffn.router and ffn.router.logit_bias else None,
                       gate, up, down, t.matrix(of(names.shared_expert_gate)) if ffn.shared_gate else None)))
    return ModelWeights(embed, t.norm(names.final_norm), lm_head, layers)


def _attention(t: _Tensors, of, prefix: str, att: Attention, names_sinks: str) -> AttentionWeights:
    p = lambda name: of(prefix + name)  # noqa: E731
    norms = att.qk_norm is not QkNorm.NONE
    # q/k norm weights are zero-centred with the rest (the hybrids' 1 + w)
    return AttentionWeights(
        *(t.matrix(p(f"{n}_proj.weight")) for n in "qkvo"),
        *(t.optional(p(f"{n}_proj.bias"), att.qkv_bias) for n in "qkv"), t.optional(p("o_proj.bias"), att.o_bias),
        t.norm(p("q_norm.weight")) if norms else None, t.norm(p("k_norm.weight")) if norms else None,
        t.optional(p(names_sinks), att.sinks))


UK_T, UV = "kv_b_proj.uk_t", "kv_b_proj.uv"  # names of kv_b_proj's halves (split_latent_kv), beside its own


def _latent(t: _Tensors, of, prefix: str, att: LatentAttention) -> LatentWeights:
    p = lambda name: of(prefix + name)  # noqa: E731
    rows = att.nope_dim + att.rope_dim
    if att.q_lora_rank:
        q, q_a, q_a_norm, q_b = None, t.matrix(p("q_a_proj.weight")), t.norm(p("q_a_layernorm.weight")), \
            t.matrix(p("q_b_proj.weight"))
    else:
        q, q_a, q_a_norm, q_b = t.matrix(p("q_proj.weight")), None, None, None
    kv_a = t.matrix(p("kv_a_proj_with_mqa.weight"))
    if p(UK_T) in t.tensors:
        uk_t, uv = t.matrix(p(UK_T)), t.matrix(p(UV))
    else:
        uk_t, uv = split_kv_b(t.matrix(p("kv_b_proj.weight")), att)
    if att.rope_interleave:  # pairs (0, 1), (2, 3)... to halves: the same rotation, as rotate-half computes it
        pairs = torch.cat([torch.arange(0, att.rope_dim, 2), torch.arange(1, att.rope_dim, 2)])
        q_index = torch.arange(att.heads * rows).view(att.heads, rows)
        q_index[:, att.nope_dim:] = q_index[:, att.nope_dim:][:, pairs]
        q_index = q_index.reshape(-1)
        kv_index = torch.cat([torch.arange(att.kv_lora_rank), att.kv_lora_rank + pairs])
        if q is not None:
            q = permute_rows(q, q_index)
        else:
            q_b = permute_rows(q_b, q_index)
        kv_a = permute_rows(kv_a, kv_index)
    return LatentWeights(q, q_a, q_a_norm, q_b, kv_a, t.norm(p("kv_a_layernorm.weight")), uk_t, uv,
                         t.matrix(p("o_proj.weight")))


def split_kv_b(kv_b: torch.Tensor, att: LatentAttention) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [heads * (nope + v), kv_lora_rank] as (uk_t [heads * kv_lora_rank, nope], each head's key
    rows transposed; uv [heads * v, kv_lora_rank], each head's value rows): a query absorbs uk_t, an
    attended latent leaves through uv, each as a matrix-vector product per head."""
    if not isinstance(kv_b, torch.Tensor):
        raise NotImplementedError("kv_b_proj must be held as stored until it is split (split_latent_kv)")
    kv_b = kv_b.view(att.heads, att.nope_dim + att.v_dim, att.kv_lora_rank)
    uk_t = kv_b[:, :att.nope_dim].transpose(1, 2).reshape(att.heads * att.kv_lora_rank, att.nope_dim).contiguous()
    return uk_t, kv_b[:, att.nope_dim:].reshape(att.heads * att.v_dim, att.kv_lora_rank).contiguous()


def split_latent_kv(recipe: ModelRecipe, names: WeightNames, tensors: dict, mode: str) -> dict:
    """tensors with each latent-attention layer's kv_b_proj replaced by its halves (split_kv_b), quantised
    as the backbone mode quantises projections (backbone.quantize_matrix): done before the backbone is laid
    out in memory, so kv_b_proj is never held twice."""
    for i, layer in enumerate(recipe.layers):
        name = names.of(i, names.attention + "kv_b_proj.weight")
        if isinstance(layer.mixer, LatentAttention) and name in tensors:
            halves = split_kv_b(tensors.pop(name), layer.mixer)
            for part, m in zip((UK_T, UV), halves):
                tensors[names.of(i, names.attention + part)] = m if mode == "bf16" else quantize_matrix(m, mode)
    return tensors


def permute_rows(m: Matrix, index: torch.Tensor) -> Matrix:
    """m with its rows in the order `index` gives; a quantised matrix's codes and row scales alike."""
    if isinstance(m, QuantizedMatrix):
        return QuantizedMatrix(m.codes[index].contiguous(), m.scales[index].contiguous(), m.fp8)
    if isinstance(m, Q4Matrix):
        return Q4Matrix(m.codes[index].contiguous(), m.scales[index].contiguous(), m.cols)
    return m[index].contiguous()


def _delta_net(t: _Tensors, of, prefix: str, dn: DeltaNet) -> DeltaNetWeights:
    p = lambda name: of(prefix + name)  # noqa: E731
    if dn.fused_projections:
        qkv, z, b, a = unfuse_qwen3_next(t.matrix(p("in_proj_qkvz.weight")), t.matrix(p("in_proj_ba.weight")),
                                         dn.key_heads, dn.value_heads, dn.key_dim, dn.value_dim)
    else:
        qkv, z, b, a = (t.matrix(p(f"in_proj_{n}.weight")) for n in ("qkv", "z", "b", "a"))
    if isinstance(qkv, torch.Tensor):  # quantised ones come out of unfuse contiguous
        qkv, z, b, a = (m.contiguous() for m in (qkv, z, b, a))
    return DeltaNetWeights(qkv, z, b, a, t.vector(p("conv1d.weight"))[:, 0, :].contiguous(),
                           -t.vector(p("A_log")).float().exp(), t.vector(p("dt_bias")), t.vector(p("norm.weight")),
                           t.matrix(p("out_proj.weight")))


def unfuse_qwen3_next(qkvz, ba, hk: int, hv: int, dk: int, dv: int):
    """Qwen3-Next's in_proj_qkvz [Hk*(2dk+2r*dv), H] and in_proj_ba [Hk*2r, H] (grouped per key head:
    [q_g | k_g | v_g (r heads) | z_g (r heads)] and [b_g (r) | a_g (r)]) as Qwen3.5's qkv, z, b, a rows.
    A row permutation, so a quantised matrix is un-fused by permuting its codes and row scales alike."""
    if isinstance(qkvz, QuantizedMatrix):
        codes = unfuse_qwen3_next(qkvz.codes, ba.codes, hk, hv, dk, dv)
        scales = unfuse_qwen3_next(qkvz.scales[:, None], ba.scales[:, None], hk, hv, dk, dv)
        return [QuantizedMatrix(c.contiguous(), s[:, 0].contiguous(), qkvz.fp8) for c, s in zip(codes, scales)]
    if isinstance(qkvz, Q4Matrix):  # codes and per-32 scales are rows too
        codes = unfuse_qwen3_next(qkvz.codes, ba.codes, hk, hv, dk, dv)
        scales = unfuse_qwen3_next(qkvz.scales, ba.scales, hk, hv, dk, dv)
        return [Q4Matrix(c.contiguous(), s.contiguous(), qkvz.cols) for c, s in zip(codes, scales)]
    r = hv // hk
    g = qkvz.view(hk, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    qkv = torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)])
    bag = ba.view(hk, 2 * r, -1)
    return qkv, z.reshape(hv * dv, -1), bag[:, :r].reshape(hv, -1), bag[:, r:].reshape(hv, -1)
