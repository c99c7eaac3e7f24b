"""The native decode step of a Decoder: every layer of one token in one native call
(native/src/decode_token.cpp), the routed experts included while the executor can hand it their records.

Built once from the recipe and the backbone's arrays (the native objects point into them, and into the
sequence state); it applies when the backbone's matrices are bf16 or quantised on the CPU and activations
are float32. The torch path of decoder.py is the reference (tests/test_decode_layer.py holds them together).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from .. import _native
from ..backbone import Q4Matrix, QuantizedMatrix
from ..ops import Q4_ISA, threads
from ..recipe import Attention, DeltaNet, LatentAttention, QkNorm, Scoring, TopkMethod
from .lookahead import RouterLookahead

_D = _native.decode
_QK_NORM = {QkNorm.NONE: 0, QkNorm.HEAD: 1, QkNorm.PROJECTION: 2}
_SCORING = {Scoring.SOFTMAX: 0, Scoring.SIGMOID: 1}
_METHOD = {TopkMethod.GREEDY: 0, TopkMethod.GROUP_LIMITED: 1, TopkMethod.NOAUX_TC: 2}


def native_matrix(w) -> "_D.Matrix | None":
    """A backbone matrix as the native step reads it, or None for one it cannot (float32, on a GPU)."""
    if isinstance(w, QuantizedMatrix):
        return _D.Matrix(w.codes.numpy(), w.scales.numpy(), 2 if w.fp8 else 1, w.shape[1])
    if isinstance(w, Q4Matrix):
        return _D.Matrix(w.codes.numpy(), w.scales.view(torch.uint16).numpy(), 3, w.cols)
    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous():
        return _D.Matrix(w.view(torch.uint16).numpy(), None, 0, w.shape[1])
    return None


def _vector(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.float().contiguous().numpy()


class _Unsupported(Exception):
    """A weight the native step cannot read: the model decodes through the torch path."""


class NativeStep:
    def __init__(self, model, step, moe_layers: list[int]):
        self.model, self.step_fn, self.moe_layers = model, step, moe_layers
        # what a layer handed back guesses of the next MoE layer, when the engine reads ahead with it
        self.lookahead: RouterLookahead | None = None
        n, k = len(model.recipe.layers), max(step.top_k, 1)
        self.scratch = np.zeros(step.scratch_floats, np.float32)
        # each layer's top-k, written by the step: [layers, top_k]
        self.topk = np.zeros((n, k), np.float32), np.zeros((n, k), np.int32)
        self.no_rope = np.zeros(0, np.float32)

    @classmethod
    def build(cls, model) -> "NativeStep | None":
        """The step for a Decoder, or None where it does not apply (weights in float32 or on a GPU,
        activations other than float32)."""
        if model.dtype != torch.float32 or any(c is not None and c.k.device.type != "cpu"
                                               for c in (model.state.kv, model.state.window)):
            return None
        try:
            layers = [_layer(model, i) for i in range(len(model.recipe.layers))]
            w = model.weights
            head = _D.DecodeHead(norm=_vector(w.final_norm), eps=model.recipe.eps, lm_head=_matrix(w.lm_head))
        except _Unsupported:
            return None
        moe = [i for i, layer in enumerate(model.recipe.layers) if layer.ffn.router is not None]
        return cls(model, _D.DecodeStep(layers, head), moe)

    def step(self, token: int, pos: int) -> torch.Tensor | None:
        """Logits [1, V] of `token` at position pos, the state extended by it; None when the KV cache's
        pages are not one run (the torch path then gathers them)."""
        model = self.model
        kv, window = model.state.kv, model.state.window
        full = ring = (None, None, None, None)
        cos = sin = self.no_rope
        if kv is not None:
            kv.reserve(pos + 1)
            run = kv.contiguous_run()
            if run is None:
                return None
            full = _run_arrays(run)
        if window is not None:
            ring = _run_arrays(window.run())
        if kv is not None or window is not None:
            cos, sin = model.rotary.cos[pos].numpy(), model.rotary.signed_sin[pos].numpy()
        x = model.weights.embed[token].to(torch.float32).numpy().copy()  # [H], updated in place layer by layer
        h = np.empty_like(x)
        weights, ids = self.topk
        experts = model.experts
        loop = experts.native_loop(self.step_fn.top_k) if self.moe_layers else None
        logits = np.empty(self.step_fn.vocab, np.float32)  # a new array: callers keep it
        n, first = len(model.recipe.layers), 0
        while True:
            stop, kernel_s = self.step_fn.run(first, Q4_ISA, threads(), x, h, pos, cos, sin, *full, weights, ids,
                                              self.scratch, loop, logits, *ring)
            if loop is not None:
                experts.ran_natively([i for i in self.moe_layers if first <= i < stop], ids, kernel_s)
            if stop == n:
                return torch.from_numpy(logits)[None]
            # the layer's shared expert, then its routed experts, into x; the executor runs the shared
            # expert once it has started the reads the routed ones need, so that it overlaps them, and
            # asks for the lookahead's guess (from h, the layer's FFN input) if it reads ahead
            shared = partial(self.step_fn.mlp, stop, Q4_ISA, threads(), x, h, self.scratch)
            guess = None if self.lookahead is None else partial(self.lookahead.guess, stop, h)
            experts.add_decode(stop, h, weights[stop], ids[stop], x, shared, guess)
            first = stop + 1


def _run_arrays(run) -> tuple:
    """(k, v, k_scale, v_scale) of a KVRun as arrays; numpy has no bf16: a bf16 cache goes as its bit patterns."""
    k, v = ((t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy() for t in (run.k, run.v))
    if run.k_scale is None:
        return k, v, None, None
    return k, v, run.k_scale.numpy(), run.v_scale.numpy()


def _matrix(w):
    m = native_matrix(w)
    if m is None:
        raise _Unsupported
    return m


def _layer(model, i: int):
    recipe, w, H = model.recipe.layers[i], model.weights.layers[i], model.recipe.hidden
    slot = model.state.slot[i]
    if isinstance(recipe.mixer, LatentAttention):
        a, aw = recipe.mixer, w.mixer
        optional = lambda m: None if m is None else _matrix(m)  # noqa: E731
        mixer = _D.LatentMixer(
            hidden=H, heads=a.heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, nope_dim=a.nope_dim,
            rope_dim=a.rope_dim, v_dim=a.v_dim, eps=model.recipe.eps, scale=a.scale, q=optional(aw.q),
            q_a=optional(aw.q_a), q_a_norm=_vector(aw.q_a_norm), q_b=optional(aw.q_b), kv_a=_matrix(aw.kv_a),
            kv_a_norm=_vector(aw.kv_a_norm), uk_t=_matrix(aw.uk_t), uv=_matrix(aw.uv), o=_matrix(aw.o), kv_layer=slot)
    elif isinstance(recipe.mixer, Attention):
        a, aw = recipe.mixer, w.mixer
        mixer = _D.AttentionMixer(
            hidden=H, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, rot_dim=a.rope.rot_dim,
            qk_norm=_QK_NORM[a.qk_norm], output_gate=a.output_gate, sliding_window=a.sliding_window or 0,
            clip_qkv=a.clip_qkv or 0.0, scale=a.scale, q=_matrix(aw.q), k=_matrix(aw.k), v=_matrix(aw.v),
            o=_matrix(aw.o), q_bias=_vector(aw.q_bias), k_bias=_vector(aw.k_bias), v_bias=_vector(aw.v_bias),
            o_bias=_vector(aw.o_bias), q_norm=_vector(aw.q_norm), k_norm=_vector(aw.k_norm), sinks=_vector(aw.sinks),
            windowed=i in model.state.windowed, kv_layer=slot)
    else:
        d: DeltaNet = recipe.mixer
        dw, state = w.mixer, model.state
        mixer = _D.DeltaNetMixer(
            hidden=H, key_heads=d.key_heads, value_heads=d.value_heads, key_dim=d.key_dim, value_dim=d.value_dim,
            conv_kernel=d.conv_kernel, eps=model.recipe.eps, qkv=_matrix(dw.qkv), z=_matrix(dw.z), b=_matrix(dw.b),
            a=_matrix(dw.a), out=_matrix(dw.out), conv=_vector(dw.conv), neg_decay=_vector(dw.neg_decay),
            dt_bias=_vector(dw.dt_bias), norm=_vector(dw.norm), conv_state=state.conv[slot].numpy(),
            recurrent=state.recurrent[slot].numpy())
    ffn, fw = recipe.ffn, w.ffn
    router = None
    if ffn.router is not None:
        r = ffn.router
        router = _D.Router(hidden=H, gate=_matrix(fw.router), scoring=_SCORING[r.scoring], method=_METHOD[r.method],
                           top_k=r.top_k, n_group=r.n_group, topk_group=r.topk_group, norm_topk_prob=r.norm_topk_prob,
                           scaling=r.scaling, score_bias=_vector(fw.router_bias),
                           logit_bias=_vector(fw.router_logit_bias))
    mlp = [None if m is None else _matrix(m) for m in (fw.gate, fw.up, fw.down)]
    return _D.DecodeLayer(hidden=H, eps=model.recipe.eps, input_norm=_vector(w.input_norm),
                          post_norm=_vector(w.post_norm), mixer=mixer, router=router, gate=mlp[0], up=mlp[1],
                          down=mlp[2], shared_gate=None if fw.shared_gate is None else _matrix(fw.shared_gate))
