"""A decoder-only MoE of any recipe: the torch reference (prefill, and every step the native decode step
does not take), and decode steps through the native step (native_step.py) where it applies.

Per layer: x += mixer(norm(x)), then x += ffn(norm(x)). Mixers: attention (GQA, optional biases, q/k norm
per head or over the projection, clipping, output gate, partial RoPE, a sliding window), multi-head latent
attention or Gated DeltaNet;
FFNs: routed experts through the executor (with an optional, optionally gated, shared expert) or a dense
MLP. Routed experts run in the executor the model is given; the model never touches vaults or rings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backbone import Q4Matrix, QuantizedMatrix
from ..experts import ExpertExecutor
from ..ops import linear
from ..routing import route
from .base import cached_attention, rms_norm, swiglu
from .delta_rule import chunk_gated_delta_rule, native_gated_delta_rule, recurrent_gated_delta_rule
from ..recipe import Attention, DeltaNet, Ffn, LatentAttention, ModelRecipe, QkNorm
from .rope import Rotary
from .state import SequenceState
from .weights import AttentionWeights, DeltaNetWeights, FfnWeights, LatentWeights, ModelWeights


def dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A matrix as a plain tensor of dtype: a quantised one dequantised (for the per-head products that
    ops.linear does not take)."""
    return w.dequantize().to(dtype) if isinstance(w, (QuantizedMatrix, Q4Matrix)) else w.to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class Decoder:
    def __init__(self, recipe: ModelRecipe, weights: ModelWeights, experts: ExpertExecutor, max_seq: int,
                 kv_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.float32):
        """Args:
            recipe: what each layer is made of (recipe.read_recipe of the vault's arch block).
            weights: the backbone's tensors for it (weights.load_weights).
            experts: runs the routed experts of a layer.
            max_seq: longest context; the sequence state is allocated here, once.
            kv_dtype: what the KV cache holds (float32; bfloat16 or int8 with row scales, for less memory).
        """
        self.recipe, self.weights, self.experts, self.dtype = recipe, weights, experts, dtype
        self.state = SequenceState(recipe, max_seq, kv_dtype)
        att = recipe.attention
        self.rotary = Rotary(att.rope, max_seq) if att is not None else None
        from .native_step import NativeStep  # the native side imports this module's reference pieces
        self.native = NativeStep.build(self)  # the fused decode step, where it applies
        self.use_native_decode = self.native is not None

    @property
    def layers(self):
        return self.weights.layers

    # --- token mixers -----------------------------------------------------------------------------
    def attention(self, att: Attention, w: AttentionWeights, slot: int, x: torch.Tensor, start: int,
                  rope, windowed: bool = False) -> torch.Tensor:
        """windowed: the layer's keys and values live in the state's window ring."""
        t, d, eps = x.shape[0], att.head_dim, self.recipe.eps  # T new tokens, D head_dim
        q = linear(x, w.q)
        k, v = linear(x, w.k), linear(x, w.v)
        if att.qkv_bias:
            q, k, v = q + w.q_bias, k + w.k_bias, v + w.v_bias
        gate = None
        if att.output_gate:  # per head: query, then gate
            qg = q.view(t, att.heads, 2 * d)
            q, gate = qg[..., :d].reshape(t, att.heads * d), qg[..., d:].reshape(t, att.heads * d)
        if att.qk_norm is QkNorm.PROJECTION:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k, v = q.view(t, att.heads, d), k.view(t, att.kv_heads, d), v.view(t, att.kv_heads, d)
        if att.qk_norm is QkNorm.HEAD:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        if att.clip_qkv is not None:
            q, k, v = (z.clamp(-att.clip_qkv, att.clip_qkv) for z in (q, k, v))
        q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        if windowed:  # rows for positions lo..start+T-1 only: the query at start is row start - lo
            k_cache, v_cache, lo = self.state.window.store(slot, start, k, v)
        else:
            (k_cache, v_cache), lo = self.state.kv.store(slot, start, k, v), 0
        o = cached_attention(q, k_cache, v_cache, start - lo, att.scale, att.sliding_window, w.sinks)  # [T, heads * D]
        if gate is not None:
            o = o * torch.sigmoid(gate)
        o = linear(o, w.o)
        return o + w.o_bias if att.o_bias else o

    def latent_attention(self, att: LatentAttention, w: LatentWeights, slot: int, x: torch.Tensor, start: int,
                         rope) -> torch.Tensor:
        """Multi-head latent attention over a latent cache, with kv_b_proj absorbed: each head's query
        meets the latent through its key rows of kv_b_proj, and its attended latent leaves through its value
        rows, so keys and values are never expanded per head (prefill included)."""
        t, h, eps = x.shape[0], att.heads, self.recipe.eps
        q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, eps), w.q_b) if att.q_lora_rank else linear(x, w.q)
        q_nope, q_pe = q.view(t, h, att.nope_dim + att.rope_dim).split([att.nope_dim, att.rope_dim], dim=-1)
        c, k_pe = linear(x, w.kv_a).split([att.kv_lora_rank, att.rope_dim], dim=-1)
        latent = torch.cat([rms_norm(c, w.kv_a_norm, eps), self.rotary.apply(k_pe[:, None, :], rope)[:, 0]], dim=-1)
        cache, _ = self.state.kv.store(slot, start, latent[:, None, :], None)
        uk = dense(w.uk_t, q.dtype).view(h, att.kv_lora_rank, att.nope_dim).transpose(1, 2)  # [heads, nope, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), uk)  # [heads, T, kv_lora_rank]
        q = torch.cat([q_latent.transpose(0, 1), self.rotary.apply(q_pe, rope)], dim=-1)  # [T, heads, latent]
        o = cached_attention(q, cache, cache, start, att.scale).view(t, h, att.latent_dim)[..., :att.kv_lora_rank]
        uv = dense(w.uv, q.dtype).view(h, att.v_dim, att.kv_lora_rank).transpose(1, 2)  # [heads, rank, v_dim]
        o = torch.bmm(o.transpose(0, 1), uv)  # [heads, T, v_dim]
        return linear(o.transpose(0, 1).reshape(t, h * att.v_dim), w.o)

    def delta_net(self, dn: DeltaNet, w: DeltaNetWeights, slot: int, x: torch.Tensor) -> torch.Tensor:
        t, kd = x.shape[0], dn.key_heads * dn.key_dim
        hv, dv = dn.value_heads, dn.value_dim
        mixed = linear(x, w.qkv)  # [T, C]
        z = linear(x, w.z).view(t, hv, dv)
        beta = torch.sigmoid(linear(x, w.b))
        g = w.neg_decay * F.softplus(linear(x, w.a) + w.dt_bias)  # log-decay <= 0
        # Causal depthwise conv over time: the rows are the state's last K-1 inputs then the new ones, and
        # each output is a weighted sum of K consecutive rows, as K multiply-adds of shifted rows in time-major
        # order (torch's grouped conv1d over a channel-major copy took three times as long at 512 tokens).
        conv_state, k_size = self.state.conv[slot], dn.conv_kernel  # [C, K-1]
        rows = torch.cat([conv_state.T, mixed])  # [K-1+T, C]
        conv = rows[:t] * w.conv[:, 0]
        for j in range(1, k_size):
            conv.addcmul_(rows[j:j + t], w.conv[:, j])
        conv_state.copy_(rows[-(k_size - 1):].T)
        conv = F.silu(conv, inplace=True)
        q = l2norm(conv[:, :kd].view(t, dn.key_heads, dn.key_dim)) * dn.key_dim ** -0.5
        k = l2norm(conv[:, kd:2 * kd].view(t, dn.key_heads, dn.key_dim))
        v = conv[:, 2 * kd:].view(t, hv, dv)
        state = self.state.recurrent[slot]
        if t > 1 and conv.device.type == "cpu":
            o = native_gated_delta_rule(q, k, v, g, beta, state)  # [T, Hv, dv]
        else:
            rep = hv // dn.key_heads  # value head h reads key head h // rep
            rule = recurrent_gated_delta_rule if t == 1 else chunk_gated_delta_rule
            o = rule(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta, state)
        o = rms_norm(o, w.norm, self.recipe.eps) * F.silu(z)
        return linear(o.reshape(t, hv * dv), w.out)

    # --- FFN ----------------------------------------------------------------------------------------
    def ffn(self, i: int, ffn: Ffn, w: FfnWeights, x: torch.Tensor) -> torch.Tensor:
        if ffn.router is None:
            return swiglu(x, w.gate, w.up, w.down)
        logits = linear(x, w.router)
        if w.router_logit_bias is not None:
            logits = logits + w.router_logit_bias
        topk_weights, topk_ids = route(logits, ffn.router, w.router_bias)
        y = self.experts(i, x, topk_weights, topk_ids)
        if ffn.intermediate:
            shared = swiglu(x, w.gate, w.up, w.down)
            if ffn.shared_gate:
                shared = torch.sigmoid(linear(x, w.shared_gate)) * shared
            y = y + shared
        return y

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False) -> torch.Tensor:
        """Logits [T, V] (float32) of tokens ids [T] at positions start..start+T-1; extends the state.
        last_only: the last position's alone, [1, V] (a prefill that only samples what follows it skips the
        head's T - 1 other rows: at Qwen3-30B's vocabulary that is most of a 16k-token prompt's head time).

        start 0 starts afresh. A model with a recurrent (DeltaNet) state continues from exactly the tokens
        it holds (start == state.length); a KV cache alone may also be cut back (start < length). A decode
        step (T == 1) runs the native step when it applies (use_native_decode).
        """
        state, t = self.state, ids.shape[0]
        if start == 0:
            state.reset()
        elif not state.resumable(start):
            raise ValueError(f"this model continues from its state ({state.length} tokens), not from {start}")
        if start + t > state.max_seq:
            raise ValueError(f"context of {start + t} tokens exceeds the KV cache ({state.max_seq}); "
                             "open the engine with a larger max_seq")
        if state.max_step is not None and t > state.max_step:  # a window ring takes so many a step
            parts = [self.forward(ids[at:at + state.max_step], start + at, last_only)
                     for at in range(0, t, state.max_step)]
            return parts[-1] if last_only else torch.cat(parts)
        self.experts.begin_step(int(ids[0]) if t == 1 else None)
        if t == 1 and self.use_native_decode:
            logits = self.native.step(int(ids[0]), start)
            if logits is not None:  # else (KV pages out of order) the torch path gathers them
                state.length = start + 1
                return logits
        windowed = set(state.windowed)
        x = self.weights.embed[ids].to(self.dtype)  # [T, H]
        rope = self.rotary.at(torch.arange(start, start + t)) if self.rotary is not None else None
        eps = self.recipe.eps
        for i, (layer, w) in enumerate(zip(self.recipe.layers, self.weights.layers)):
            h = rms_norm(x, w.input_norm, eps)
            if isinstance(layer.mixer, Attention):
                x = x + self.attention(layer.mixer, w.mixer, state.slot[i], h, start, rope, i in windowed)
            elif isinstance(layer.mixer, LatentAttention):
                x = x + self.latent_attention(layer.mixer, w.mixer, state.slot[i], h, start, rope)
            else:
                x = x + self.delta_net(layer.mixer, w.mixer, state.slot[i], h)
            x = x + self.ffn(i, layer.ffn, w.ffn, rms_norm(x, w.post_norm, eps))
        state.length = start + t
        if last_only:
            x = x[-1:]
        return linear(rms_norm(x, self.weights.final_norm, eps), self.weights.lm_head).float()
