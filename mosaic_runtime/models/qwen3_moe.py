"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA attention with q/k RMSNorm and RoPE, softmax top-k
routed experts, optional dense MLP layers. Settings come from the vault's arch block, weights from the
backbone; routed experts run through the executor it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .. import _native
from ..backbone import Q4Matrix, QuantizedMatrix
from ..experts import ExpertExecutor
from ..ops import Q4_ISA, linear, threads
from ..kv_cache import KVCache, KVRun
from ..routing import ROUTERS
from .base import Rotary, cached_attention, rms_norm, swiglu

decode_layers = _native.kernels.decode_layers  # a module name, so benchmarks/token_profile.py can time it


@dataclass
class Layer:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [heads * D, H]
    k_proj: torch.Tensor  # [kv_heads * D, H]
    v_proj: torch.Tensor  # [kv_heads * D, H]
    o_proj: torch.Tensor  # [H, heads * D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    router: torch.Tensor | None  # [E, H] for MoE layers
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # gate, up, down of a dense layer


class Qwen3Moe:
    def __init__(self, arch: dict, weights: Mapping[str, torch.Tensor], experts: ExpertExecutor, max_seq: int,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype = torch.float32):
        """Args:
            arch: the vault's arch block.
            weights: backbone tensors by their checkpoint names.
            experts: runs the routed experts of a layer.
            max_seq: KV cache length, allocated here once.
            kv_dtype: what the KV cache holds (float32; bfloat16 or int8 with row scales, for less memory).
        """
        self.arch, self.experts, self.dtype = arch, experts, dtype
        self.heads, self.kv_heads, self.head_dim = arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]
        self.eps, self.top_k = arch["rms_norm_eps"], arch["num_experts_per_tok"]
        self.route = ROUTERS[arch["scoring_func"]]
        if arch["hidden_act"] != "silu":
            raise NotImplementedError(f"hidden_act {arch['hidden_act']!r} is not supported")
        # Matrices stay as stored (bf16: ops.linear widens them inside the dot product); norms are float32.
        w = lambda name: weights[name] if weights[name].dim() == 2 else weights[name].to(dtype)  # noqa: E731
        # (a matrix may also be a backbone.QuantizedMatrix: 2-D, run by ops.linear)
        self.embed = w("model.embed_tokens.weight")  # [V, H]
        self.norm = w("model.norm.weight")
        # A tied head may still have its own (quantised) copy: see backbone.prepare_backbone.
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in weights else self.embed
        self.layers = []
        for i, kind in enumerate(arch["layer_kinds"]):
            p = f"model.layers.{i}."
            attn = [w(p + f"self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
            moe = kind == "moe"
            self.layers.append(Layer(
                w(p + "input_layernorm.weight"), w(p + "post_attention_layernorm.weight"), *attn,
                router=w(p + "mlp.gate.weight") if moe else None,
                mlp=None if moe else tuple(w(p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))))
        self.rotary = Rotary(arch["rope"], self.head_dim, max_seq)
        self.kv = KVCache(len(self.layers), max_seq, self.kv_heads, self.head_dim, kv_dtype)
        self.scale = self.head_dim ** -0.5
        self.native_layers = self._native_layers()  # the fused decode step, where it applies
        self.use_native_decode = self.native_layers is not None

    def attention(self, i: int, layer: Layer, x: torch.Tensor, start: int, rope) -> torch.Tensor:
        t = x.shape[0]  # T new tokens, D head_dim
        q = rms_norm(linear(x, layer.q_proj).view(t, self.heads, self.head_dim), layer.q_norm, self.eps)
        k = rms_norm(linear(x, layer.k_proj).view(t, self.kv_heads, self.head_dim), layer.k_norm, self.eps)
        v = linear(x, layer.v_proj).view(t, self.kv_heads, self.head_dim)
        q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        k_cache, v_cache = self.kv.store(i, start, k, v)
        return linear(cached_attention(q, k_cache, v_cache, start, self.scale), layer.o_proj)  # [T, H]

    def mlp(self, i: int, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.mlp is not None:
            gate, up, down = layer.mlp
            return swiglu(x, gate, up, down)
        topk_weights, topk_ids = self.route(linear(x, layer.router), self.top_k, self.arch["norm_topk_prob"])
        return self.experts(i, x, topk_weights, topk_ids)

    def _native_layers(self) -> list | None:
        """One native DecodeLayer per layer (native/src/decode_layer.cpp): a decode step's attention block
        and router in one call each (a float32, bf16 or int8 KV cache). None where it does not apply:
        weights on a GPU or in float32, activations other than float32."""
        def matrix(w):
            if isinstance(w, QuantizedMatrix):
                return (w.codes.numpy(), w.scales.numpy(), 2 if w.fp8 else 1)
            if isinstance(w, Q4Matrix):
                return (w.codes.numpy(), w.scales.view(torch.uint16).numpy(), 3, w.cols)
            if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous():
                return (w.view(torch.uint16).numpy(), None, 0)
            return None

        if self.dtype != torch.float32 or self.kv.k.device.type != "cpu":
            return None
        geometry = dict(hidden=self.embed.shape[1], heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                        rot_dim=self.rotary.rot_dim, top_k=self.top_k, norm_topk_prob=int(self.arch["norm_topk_prob"]),
                        eps=self.eps, scale=self.scale)
        layers = []
        for layer in self.layers:
            mats = [matrix(w) for w in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
            router = matrix(layer.router) if layer.router is not None else ()  # () for a dense layer
            if any(m is None for m in mats) or router is None:
                return None
            layers.append(_native.kernels.DecodeLayer(
                geometry, layer.input_norm.numpy(), layer.post_norm.numpy(), layer.q_norm.numpy(),
                layer.k_norm.numpy(), *mats, router))
        head = matrix(self.lm_head)  # the final norm and lm_head, run by the loop's last call
        self._head = None if head is None else (_native.kernels.DecodeHead(self.norm.numpy(), self.eps, head),
                                                head[0].shape[0])
        self._scratch = np.zeros(max(n.scratch_floats for n in layers), np.float32)
        # each layer's top-k, written by decode_layers: [layers, top_k]
        self._topk = np.zeros((len(layers), self.top_k), np.float32), np.zeros((len(layers), self.top_k), np.int32)
        return layers

    def _decode_native(self, token: int, pos: int, run: KVRun) -> torch.Tensor:
        """One decode step through the native layers, its page already reserved and `run` the cache's
        contiguous views; the same result as the torch path of forward() within float rounding
        (tests/test_decode_layer.py holds them together).

        decode_layers runs the layers in one native call, each MoE layer's experts included while the
        executor can hand it their records (native_loop); it returns at the first layer it cannot finish
        (a dense MLP, an expert not in the ring), which runs here, and is called again from the next. The
        call that finishes the last layer also runs the final norm and lm_head (the head)."""
        x = self.embed[token].to(torch.float32).numpy().copy()  # [H], updated in place layer by layer
        h = np.empty_like(x)
        n = len(self.layers)
        weights, ids = self._topk
        cos, signed_sin = self.rotary.cos[pos].numpy(), self.rotary.signed_sin[pos].numpy()
        # Q4 projections want the VNNI kernel; bf16, int8, fp8 and attention run the same AVX-512 code under it.
        isa, n_threads = Q4_ISA, threads()
        native_loop = getattr(self.experts, "native_loop", None)
        experts = native_loop(self.top_k) if native_loop is not None else None
        add_experts = getattr(self.experts, "add_decode", None)
        # numpy has no bf16: a bf16 cache goes as its bit patterns, which decode_layers reads as bf16
        k_run, v_run = ((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy() for t in (run.k, run.v))
        kv_scales = None if run.k_scale is None else (run.k_scale.numpy(), run.v_scale.numpy())
        logits = None if self._head is None else np.empty(self._head[1], np.float32)  # a new array: callers keep it
        head = None if logits is None else (self._head[0], logits)
        first = 0
        while True:
            stop, kernel_s = decode_layers(self.native_layers, first, isa, n_threads, x, h, pos, cos, signed_sin, k_run,
                                           v_run, kv_scales, weights, ids, self._scratch, experts, head)
            if experts is not None:
                self.experts.ran_natively(range(first, stop), ids, kernel_s)
            if stop == n:
                break
            layer = self.layers[stop]
            if layer.mlp is not None:
                x += swiglu(torch.from_numpy(h)[None], *layer.mlp)[0].numpy()
            elif add_experts is not None:  # the executor adds the experts into x itself
                add_experts(stop, h, weights[stop], ids[stop], x)
            else:
                x += self.experts(stop, torch.from_numpy(h)[None], torch.from_numpy(weights[stop])[None],
                                  torch.from_numpy(ids[stop])[None])[0].numpy()
            first = stop + 1
        self.kv.length = pos + 1
        if logits is not None:
            return torch.from_numpy(logits)[None]
        return linear(rms_norm(torch.from_numpy(x)[None], self.norm, self.eps), self.lm_head).float()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [T, V] (float32) of tokens ids [T] at positions start..start+T-1; extends the KV cache.

        A decode step (T == 1) runs the native layers when they apply (use_native_decode); everything
        else, and the reference, runs the torch ops below.
        """
        if ids.shape[0] == 1 and self.use_native_decode:
            self.kv.reserve(start + 1)
            run = self.kv.contiguous_run()
            if run is not None:  # else (pages out of order) the torch path gathers them
                return self._decode_native(int(ids[0]), start, run)
        x = self.embed[ids].to(self.dtype)  # [T, H]
        rope = self.rotary.at(torch.arange(start, start + ids.shape[0]))  # shared by every layer
        for i, layer in enumerate(self.layers):
            x = x + self.attention(i, layer, rms_norm(x, layer.input_norm, self.eps), start, rope)
            x = x + self.mlp(i, layer, rms_norm(x, layer.post_norm, self.eps))
        self.kv.length = start + ids.shape[0]
        return linear(rms_norm(x, self.norm, self.eps), self.lm_head).float()
