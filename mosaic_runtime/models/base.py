"""The torch ops every recipe shares: RMSNorm, SwiGLU MLPs and attention over a KV cache."""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .. import _native
from ..kv_cache import Int8Rows
from ..ops import linear, threads

_K = _native.kernels
_ISA = _K.best_isa()
# An int8 KV cache is opt-in and lossy already: it takes the integer kernel where there is one (AVX-512
# VNNI), which rounds queries and probabilities to 16 bits (about 1e-4 of the output, against the codes' 1/254).
_I8_ISA = _K.AVX512_VNNI if _K.isa_available(_K.AVX512_VNNI) else _ISA
_DECODE_KERNELS = {torch.float32: _K.decode_attention, torch.bfloat16: _K.decode_attention_bf16}
# A prompt chunk's attention runs through the decode tasks where they beat torch's fused kernel (benchmarks/
# RESULTS.md, "A prompt's attention through the decode tasks"): the AVX-512 task 1.2-3.7x over every chunk; the
# AVX2 one 1.3-1.7x over a chunk with nothing before it, but it reads a long prefix slower than torch. On AMX CPUs
# torch attends a bf16 cache in tiles. An int8 cache's rows are widened as they are read, not dequantized first.
_WIDE = _K.isa_available(_K.AVX512)
_FIRST_CHUNK_ONLY = not _WIDE and _K.isa_available(_K.AVX2)
_PREFILL_KERNELS = {  # cache dtype -> (kernel, the head_dim multiple its task takes)
    torch.float32: (_K.prefill_attention, 16 if _WIDE else 8),
    torch.int8: (_K.prefill_attention_i8, 32 if _WIDE else 8),
    **({} if _K.isa_available(_K.AMX) else {torch.bfloat16: (_K.prefill_attention_bf16, 32 if _WIDE else 8)}),
} if _WIDE or _FIRST_CHUNK_ONLY else {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (as transformers' Qwen3MoeRMSNorm): on the CPU the
    native decode step's norm over every row (its sum of squares in double), elsewhere one fused op when
    activations are float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.device.type == "cpu" and not x.requires_grad:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            y = np.empty(rows.shape, np.float32)
            _K.rms_norm_rows(threads(), rows.numpy(), weight.contiguous().numpy(), eps, y)
            return torch.from_numpy(y).view(x.shape)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """down(silu(gate x) * up x) on backbone weights as held (bf16 or quantised): dense MLPs and shared
    experts. Routed experts go through an ExpertExecutor instead."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor | Int8Rows, v_cache: torch.Tensor | Int8Rows,
                     start: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of T new queries at positions start..start+T-1 over cache[:start+T] (float32,
    bf16, or an int8 cache's codes and row scales), each query seeing the last `window` positions only when
    a window is given: a decode step (T == 1) on the CPU runs the native kernel (native/src/attention.cpp,
    each key and value read once for the query heads that share it); a prompt chunk on the CPU without a
    window or sinks runs native_prefill_attention where it serves, else prefill_attention; everything else,
    and the reference, is torch_attention (an int8 cache dequantized first). sinks [Hq]: torch_attention's."""
    end = start + q.shape[0]
    sink_arg = None if sinks is None else sinks.float().contiguous().numpy()
    if q.shape[0] == 1 and window is not None and end > window:  # a decode step sees the window's keys only
        lo = end - window
        k_cache, v_cache = ((Int8Rows(*(t[:, lo:end] for t in c)) if isinstance(c, Int8Rows) else c[:, lo:end])
                            for c in (k_cache, v_cache))
        start, end, window = window - 1, window, None
    if q.shape[0] > 1 and window is None and sinks is None and q.device.type == "cpu":
        out = native_prefill_attention(q, k_cache, v_cache, start, scale)
        if out is not None:
            return out
    if isinstance(k_cache, Int8Rows):  # an int8 cache: codes and a scale per row
        k, v = Int8Rows(*(t[:, :end] for t in k_cache)), Int8Rows(*(t[:, :end] for t in v_cache))
        if q.shape[0] == 1 and q.device.type == "cpu" and _rows_contiguous(k.codes, v.codes):
            hq, d = q.shape[1], q.shape[2]
            out = np.empty((hq, d), np.float32)
            _K.decode_attention_i8(_I8_ISA, threads(), q.reshape(hq, d).contiguous().numpy(), k.codes.numpy(),
                                   v.codes.numpy(), k.scales.numpy(), v.scales.numpy(), scale, out, sink_arg)
            return torch.from_numpy(out).view(1, hq * d)
        return torch_attention(q, k.dequantize(), v.dequantize(), start, scale, window, sinks)
    if q.shape[0] == 1 and q.device.type == "cpu" and k_cache.dtype in _DECODE_KERNELS:
        k, v = k_cache[:, :end], v_cache[:, :end]
        if _rows_contiguous(k, v):
            hq, d = q.shape[1], q.shape[2]
            out = np.empty((hq, d), np.float32)
            qs = q.reshape(hq, d).contiguous().numpy()
            if k.dtype == torch.bfloat16:  # handed over as their bit patterns
                k, v = k.view(torch.uint16), v.view(torch.uint16)
            _DECODE_KERNELS[k_cache.dtype](_ISA, threads(), qs, k.numpy(), v.numpy(), scale, out, sink_arg)
            return torch.from_numpy(out).view(1, hq * d)
    if q.shape[0] > 1 and window is None and sinks is None and q.device.type == "cpu" and _FLASH is not None:
        return prefill_attention(q, k_cache, v_cache, start, scale)
    return torch_attention(q, k_cache, v_cache, start, scale, window, sinks)


def native_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor | Int8Rows, v_cache: torch.Tensor | Int8Rows,
                             start: int, scale: float) -> torch.Tensor | None:
    """A prompt chunk's causal attention (T > 1, no window, no sinks) through the decode tasks of
    native/src/attention.cpp (attend_prompt), or None where they do not serve this CPU, cache or head size."""
    t, hq, d = q.shape
    int8 = isinstance(k_cache, Int8Rows)
    kernel, multiple = _PREFILL_KERNELS.get(torch.int8 if int8 else k_cache.dtype, (None, 0))
    k, v = (k_cache.codes, v_cache.codes) if int8 else (k_cache, v_cache)
    if kernel is None or q.dtype != torch.float32 or d % multiple or (_FIRST_CHUNK_ONLY and start > 0) or \
            not _rows_contiguous(k, v):
        return None
    if k.dtype == torch.bfloat16:  # handed over as their bit patterns
        k, v = k.view(torch.uint16), v.view(torch.uint16)
    out = np.empty((t, hq * d), np.float32)
    scales = (k_cache.scales.numpy(), v_cache.scales.numpy()) if int8 else ()
    kernel(_ISA, threads(), q.contiguous().numpy(), k.numpy(), v.numpy(), *scales, start, scale, out)
    return torch.from_numpy(out)


# torch's fused CPU attention, which also returns each row's log-sum-exp (what lets two key ranges combine)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                      scale: float) -> torch.Tensor:
    """torch_attention for a prompt chunk (T > 1, no window, no sinks) on the CPU, in two key ranges: the
    positions before the chunk, which every query sees (no mask at all), and the chunk's own, under the
    causal mask; the two softmaxes are merged by their log-sum-exps. A mask over the whole context made the
    fused kernel read and add a mask element for every score (1.3x this at 16k positions). A bf16 cache is
    attended in bf16 as stored (queries rounded to bf16, sums and softmax in float32 in the kernel): a
    quarter of float32's time on an AMX CPU, and no widened copy of the cache."""
    t, hq, d = q.shape
    hkv = k_cache.shape[0]
    rep = hq // hkv
    dt = torch.bfloat16 if k_cache.dtype == torch.bfloat16 else torch.float32
    qh = q.to(dt).reshape(t, hkv, rep, d).permute(1, 2, 0, 3).reshape(1, hkv, rep * t, d)  # rows: (r, t)
    k, v = k_cache[None, :, :start + t].to(dt), v_cache[None, :, :start + t].to(dt)
    out, lse = _FLASH(qh, k[:, :, start:], v[:, :, start:], attn_mask=_causal_mask(t, rep, dt), scale=scale)
    if start > 0:
        before, lse_before = _FLASH(qh, k[:, :, :start], v[:, :, :start], scale=scale)
        top = torch.maximum(lse, lse_before)
        w, w_before = torch.exp(lse - top)[..., None], torch.exp(lse_before - top)[..., None]
        out = (out.float() * w + before.float() * w_before) / (w + w_before)
    return out[0].float().reshape(hkv, rep, t, d).permute(2, 0, 1, 3).reshape(t, hq * d)


@functools.lru_cache(maxsize=4)
def _causal_mask(t: int, rep: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask of a chunk's own positions for prefill_attention's rows (r, t): [rep * t, t].
    Built once per chunk shape, not per layer (the kernel only reads it)."""
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.zeros(t, t, dtype=dtype).masked_fill_(~causal, float("-inf")).repeat(rep, 1)


def _rows_contiguous(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                    scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of T new queries at positions start..start+T-1 over cache[:start+T], in torch;
    with a window, query i sees positions i-window+1..i only.

    The query heads of one KV head are folded into the query rows, so keys and values are read in place,
    never repeated per query head (at 32k tokens that copy would cost more than the attention).

    Args:
        q: [T, Hq, D]; k_cache, v_cache: [Hkv, S, D] (head-major, as the KV cache returns them), holding
            the keys/values up to start+T.
        sinks: [Hq] or None: query head j's softmax takes exp(sinks[j]) into its denominator, an extra
            column with no value (gpt-oss's attention sinks).
    Returns:
        [T, Hq * D]
    """
    t, hq, d = q.shape
    end = start + t
    hkv = k_cache.shape[0]
    rep = hq // hkv  # query head j reads KV head j // rep
    k, v = k_cache[:, :end].to(q.dtype), v_cache[:, :end].to(q.dtype)  # a bf16 cache is widened here
    qh = q.reshape(t, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * t, d)  # rows: (r, t)
    if sinks is not None:  # the sink is one more logit per row: softmax over it, then it is dropped
        mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
        if window is not None:
            mask &= torch.ones(t, end, dtype=torch.bool).triu(diagonal=start - window + 1)
        scores = ((qh @ k.transpose(1, 2)) * scale).masked_fill(~mask.repeat(rep, 1), float("-inf"))
        sink = sinks.to(scores.dtype).view(hkv, rep, 1, 1).expand(hkv, rep, t, 1).reshape(hkv, rep * t, 1)
        out = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v
    elif t == 1 and (window is None or end <= window):  # plain matmuls read the cache at 2x torch's fused CPU kernel
        out = torch.softmax((qh @ k.transpose(1, 2)) * scale, dim=-1) @ v
    else:  # query i sees keys 0..start+i (the last `window` of them)
        mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
        if window is not None:
            mask &= torch.ones(t, end, dtype=torch.bool).triu(diagonal=start - window + 1)
        mask = mask.repeat(rep, 1)
        # as a batch of one: torch's fused CPU kernel takes 4-D inputs only (3-D ones ran the unfused path,
        # 2x slower on a 512-token prefill)
        out = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=mask, scale=scale)[0]  # [Hkv, rep*T, D]
    return out.reshape(hkv, rep, t, d).permute(2, 0, 1, 3).reshape(t, hq * d)
