"""Hybrid Qwen3-Next and Qwen3.5/3.6-MoE: three of every four layers are Gated DeltaNet (linear attention
with a constant-size state), every fourth is gated full attention over a KV cache; every MoE block has a
shared expert beside the routed ones. The two families are one network; Qwen3-Next stores the DeltaNet
input projections fused and interleaved per key head, which is undone here once, at load.

Norms are zero-centred (x * (1 + w)) except the DeltaNet output norm (w * x, then * silu(z)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ..backbone import Q4Matrix, QuantizedMatrix
from ..experts import ExpertExecutor
from ..kv_cache import KVCache
from ..ops import linear
from ..routing import ROUTERS
from .base import Rotary, cached_attention, rms_norm, swiglu
from .delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@dataclass
class DeltaNet:
    qkv: torch.Tensor  # [2*Hk*dk + Hv*dv, H]: q heads, k heads, v heads (the conv's channel order)
    z: torch.Tensor  # [Hv*dv, H] output gate
    b: torch.Tensor  # [Hv, H] -> beta
    a: torch.Tensor  # [Hv, H] -> decay
    conv: torch.Tensor  # [C, K] depthwise taps; [:, K-1] multiplies the current token
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [dv]
    out: torch.Tensor  # [H, Hv*dv]


@dataclass
class GatedAttention:
    q_proj: torch.Tensor  # [heads * 2D, H]: per head, query then gate
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor  # [D], 1 + w
    k_norm: torch.Tensor


@dataclass
class Mlp:
    router: torch.Tensor | None  # [E, H]; None for a dense layer
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # shared expert gate, up, down (or dense MLP)
    shared_gate: torch.Tensor | None  # [1, H]


@dataclass
class Layer:
    input_norm: torch.Tensor  # 1 + w
    post_norm: torch.Tensor
    mixer: DeltaNet | GatedAttention
    mlp: Mlp


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


class HybridState:
    """What a sequence leaves behind: the full-attention layers' KV cache and, per DeltaNet layer, the
    conv window and the recurrent state, all allocated once. The recurrent state cannot be rewound, so
    a conversation can keep all of it or none (`rewindable` is False)."""

    rewindable = False

    def __init__(self, n_attention: int, max_seq: int, kv_heads: int, head_dim: int, n_delta: int, channels: int,
                 kernel: int, hv: int, dk: int, dv: int, kv_dtype: torch.dtype = torch.float32):
        self.kv = KVCache(n_attention, max_seq, kv_heads, head_dim, kv_dtype)
        self.conv = torch.zeros(n_delta, channels, kernel - 1)  # the last K-1 pre-conv inputs, oldest first
        self.recurrent = torch.zeros(n_delta, hv, dk, dv)
        self.length = 0

    @property
    def max_seq(self) -> int:
        return self.kv.max_seq

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()
        self.kv.reset()
        self.length = 0

    @property
    def state_bytes(self) -> int:
        """The DeltaNet layers' conv windows and recurrent states: constant, whatever the context."""
        return (self.conv.numel() + self.recurrent.numel()) * self.recurrent.element_size()


class Qwen3Next:
    def __init__(self, arch: dict, weights: Mapping[str, torch.Tensor], experts: ExpertExecutor, max_seq: int,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype = torch.float32):
        self.arch, self.experts, self.dtype = arch, experts, dtype
        self.heads, self.kv_heads, self.head_dim = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]
        self.eps, self.top_k = arch["rms_norm_eps"], arch["num_experts_per_tok"]
        self.route = ROUTERS[arch["scoring_func"]]
        la = arch["linear_attention"]
        self.hk, self.hv = la["num_key_heads"], la["num_value_heads"]
        self.dk, self.dv, self.kernel = la["key_head_dim"], la["value_head_dim"], la["conv_kernel"]
        if arch["hidden_act"] != "silu":
            raise NotImplementedError(f"hidden_act {arch['hidden_act']!r} is not supported")
        mat = lambda name: weights[name]  # noqa: E731  (matrices stay as stored: ops.linear widens bf16)
        vec = lambda name: weights[name].to(dtype)  # noqa: E731
        one_plus = lambda name: 1.0 + weights[name].to(dtype)  # noqa: E731
        self.embed = mat("model.embed_tokens.weight")
        self.norm = one_plus("model.norm.weight")
        # A tied head may still have its own (quantised) copy: see backbone.prepare_backbone.
        self.lm_head = mat("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.layers: list[Layer] = []
        self.slot: list[int] = []  # index of the layer among its kind (KV cache row or DeltaNet state row)
        n_att = n_delta = 0
        for i, (kind, mixer_type) in enumerate(zip(arch["layer_kinds"], arch["layer_types"])):
            p = f"model.layers.{i}."
            if mixer_type == "full_attention":
                s = p + "self_attn."
                mixer = GatedAttention(mat(s + "q_proj.weight"), mat(s + "k_proj.weight"), mat(s + "v_proj.weight"),
                                       mat(s + "o_proj.weight"), one_plus(s + "q_norm.weight"),
                                       one_plus(s + "k_norm.weight"))
                self.slot.append(n_att)
                n_att += 1
            else:
                s = p + "linear_attn."
                if la["projections"] == "fused_qkvz_ba":
                    qkv, z, b, a = unfuse_qwen3_next(mat(s + "in_proj_qkvz.weight"), mat(s + "in_proj_ba.weight"),
                                                     self.hk, self.hv, self.dk, self.dv)
                else:
                    qkv, z, b, a = (mat(s + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a"))
                if isinstance(qkv, torch.Tensor):  # quantised ones come out of unfuse contiguous
                    qkv, z, b, a = (m.contiguous() for m in (qkv, z, b, a))
                mixer = DeltaNet(qkv, z, b, a,
                                 vec(s + "conv1d.weight")[:, 0, :], vec(s + "A_log"), vec(s + "dt_bias"),
                                 vec(s + "norm.weight"), mat(s + "out_proj.weight"))
                self.slot.append(n_delta)
                n_delta += 1
            m = p + "mlp."
            if kind == "moe":
                shared = tuple(mat(m + f"shared_expert.{n}_proj.weight") for n in ("gate", "up", "down")) \
                    if arch["shared_expert_intermediate_size"] else None
                gate = mat(m + "shared_expert_gate.weight") if shared and arch.get("shared_expert_gate") else None
                mlp = Mlp(mat(m + "gate.weight"), shared, gate)
            else:
                mlp = Mlp(None, tuple(mat(m + f"{n}_proj.weight") for n in ("gate", "up", "down")), None)
            self.layers.append(Layer(one_plus(p + "input_layernorm.weight"),
                                     one_plus(p + "post_attention_layernorm.weight"), mixer, mlp))
        self.rotary = Rotary(arch["rope"], self.head_dim, max_seq)
        channels = 2 * self.hk * self.dk + self.hv * self.dv
        self.kv = HybridState(n_att, max_seq, self.kv_heads, self.head_dim, n_delta, channels, self.kernel,
                              self.hv, self.dk, self.dv, kv_dtype)
        self.scale = self.head_dim ** -0.5

    def attention(self, layer: GatedAttention, slot: int, x: torch.Tensor, start: int, rope) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        qg = linear(x, layer.q_proj).view(t, self.heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, self.heads * d)
        q = rms_norm(q, layer.q_norm, self.eps)
        k = rms_norm(linear(x, layer.k_proj).view(t, self.kv_heads, d), layer.k_norm, self.eps)
        v = linear(x, layer.v_proj).view(t, self.kv_heads, d)
        q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        k_cache, v_cache = self.kv.kv.store(slot, start, k, v)
        o = cached_attention(q, k_cache, v_cache, start, self.scale) * torch.sigmoid(gate)
        return linear(o, layer.o_proj)

    def delta_net(self, layer: DeltaNet, slot: int, x: torch.Tensor) -> torch.Tensor:
        t, kd = x.shape[0], self.hk * self.dk
        mixed = linear(x, layer.qkv)  # [T, C]
        z = linear(x, layer.z).view(t, self.hv, self.dv)
        beta = torch.sigmoid(linear(x, layer.b))
        g = -layer.a_log.float().exp() * F.softplus(linear(x, layer.a) + layer.dt_bias)
        # Causal depthwise conv over time: the window is the state's last K-1 inputs then the new ones.
        window = torch.cat([self.kv.conv[slot], mixed.T], dim=1)  # [C, K-1+T]
        conv = F.conv1d(window[None], layer.conv[:, None, :], groups=window.shape[0])[0].T  # [T, C]
        self.kv.conv[slot].copy_(window[:, -(self.kernel - 1):])
        conv = F.silu(conv)
        rep = self.hv // self.hk  # value head h reads key head h // rep
        q = l2norm(conv[:, :kd].view(t, self.hk, self.dk).repeat_interleave(rep, 1)) * self.dk ** -0.5
        k = l2norm(conv[:, kd:2 * kd].view(t, self.hk, self.dk).repeat_interleave(rep, 1))
        v = conv[:, 2 * kd:].view(t, self.hv, self.dv)
        rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
        o = rule(q, k, v, g, beta, self.kv.recurrent[slot])  # [T, Hv, dv]
        o = rms_norm(o, layer.norm, self.eps) * F.silu(z)
        return linear(o.reshape(t, self.hv * self.dv), layer.out)

    def mlp(self, i: int, mlp: Mlp, x: torch.Tensor) -> torch.Tensor:
        if mlp.router is None:
            return swiglu(x, *mlp.shared)
        topk_weights, topk_ids = self.route(linear(x, mlp.router), self.top_k, self.arch["norm_topk_prob"])
        y = self.experts(i, x, topk_weights, topk_ids)
        if mlp.shared is not None:
            shared = swiglu(x, *mlp.shared)
            if mlp.shared_gate is not None:
                shared = torch.sigmoid(linear(x, mlp.shared_gate)) * shared
            y = y + shared
        return y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [T, V] (float32) of tokens ids [T] at positions start..start+T-1, continuing the state.

        The DeltaNet state holds exactly `self.kv.length` tokens, so start must equal it (or be 0, which
        starts afresh).
        """
        if start == 0:
            self.kv.reset()
        elif start != self.kv.length:
            raise ValueError(f"a hybrid model continues from its state ({self.kv.length} tokens), not from {start}")
        if start + ids.shape[0] > self.kv.max_seq:
            raise ValueError(f"context of {start + ids.shape[0]} tokens exceeds the KV cache ({self.kv.max_seq}); "
                             "open the engine with a larger max_seq")
        x = self.embed[ids].to(self.dtype)
        rope = self.rotary.at(torch.arange(start, start + ids.shape[0]))  # shared by the attention layers
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            if isinstance(layer.mixer, GatedAttention):
                x = x + self.attention(layer.mixer, self.slot[i], h, start, rope)
            else:
                x = x + self.delta_net(layer.mixer, self.slot[i], h)
            x = x + self.mlp(i, layer.mlp, rms_norm(x, layer.post_norm, self.eps))
        self.kv.length = start + ids.shape[0]
        return linear(rms_norm(x, self.norm, self.eps), self.lm_head).float()

