"""What every model family shares: norms, rotary embeddings and the attention over a KV cache."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .. import _native
from ..kv_cache import Int8Rows
from ..ops import linear, threads

_ISA = _native.kernels.best_isa()
# An int8 KV cache is opt-in and lossy already: it takes the integer (VNNI) kernel where there is one,
# which rounds queries and probabilities to 16 bits (about 1e-4 of the output, against the codes' 1/254).
_I8_ISA = _native.kernels.AVX512_VNNI if _native.kernels.isa_available(_native.kernels.AVX512_VNNI) else _ISA
_DECODE_KERNELS = {torch.float32: _native.kernels.decode_attention, torch.bfloat16: _native.kernels.decode_attention_bf16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (as transformers' Qwen3MoeRMSNorm), in one fused op
    when activations are float32 (the token loop calls this 4 times a layer)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """down(silu(gate x) * up x) on backbone weights as held (bf16 or quantised): dense MLPs and shared
    experts. Routed experts go through an ExpertExecutor instead."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


class Rotary:
    """RoPE tables for positions 0..max_positions-1, built once at start-up.

    Supports the default (unscaled) and linear rope types and a partial rotary factor; others are refused
    when the engine opens, not in the token loop.
    """

    SUPPORTED = ("default", "linear")

    def __init__(self, rope: dict, head_dim: int, max_positions: int):
        if rope["type"] not in self.SUPPORTED:
            raise NotImplementedError(f"rope type {rope['type']!r} is not supported yet")
        self.rot_dim = int(head_dim * rope["partial_rotary_factor"])
        inv_freq = 1.0 / (rope["theta"] ** (torch.arange(0, self.rot_dim, 2, dtype=torch.int64).float() / self.rot_dim))
        pos = torch.arange(max_positions, dtype=torch.float32)
        if rope["type"] == "linear":
            pos = pos / float(rope["scaling"]["factor"])
        freqs = torch.outer(pos, inv_freq)  # [P, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, rot]
        self.cos = emb.cos()
        # rotate_half(x) * sin == roll(x, rot/2) * sin with its first half negated: the same products, one
        # op instead of a slice, a negation and a concatenation.
        self.signed_sin = emb.sin() * torch.cat([-torch.ones(self.rot_dim // 2), torch.ones(self.rot_dim // 2)])

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for positions [T], looked up once per forward pass and shared by every layer."""
        return self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]  # [T, 1, rot]

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, head_dim] rotated with tables = at(positions) (rotate-half convention)."""
        cos, signed_sin = tables
        if self.rot_dim == x.shape[-1]:
            return x * cos + x.roll(self.rot_dim // 2, dims=-1) * signed_sin
        rot, rest = x[..., :self.rot_dim], x[..., self.rot_dim:]
        return torch.cat([rot * cos + rot.roll(self.rot_dim // 2, dims=-1) * signed_sin, rest], dim=-1)


def cached_attention(q: torch.Tensor, k_cache: torch.Tensor | Int8Rows, v_cache: torch.Tensor | Int8Rows,
                     start: int, scale: float) -> torch.Tensor:
    """Causal GQA attention of T new queries at positions start..start+T-1 over cache[:start+T] (float32,
    bf16, or an int8 cache's codes and row scales): a decode step (T == 1) on the CPU runs the native
    kernel (native/src/attention.cpp, each key and value read once for the query heads that share it);
    everything else, and the reference, is torch_attention (an int8 cache dequantized first)."""
    end = start + q.shape[0]
    if isinstance(k_cache, Int8Rows):  # an int8 cache: codes and a scale per row
        k, v = Int8Rows(*(t[:, :end] for t in k_cache)), Int8Rows(*(t[:, :end] for t in v_cache))
        if q.shape[0] == 1 and q.device.type == "cpu" and _rows_contiguous(k.codes, v.codes):
            hq, d = q.shape[1], q.shape[2]
            out = np.empty((hq, d), np.float32)
            _native.kernels.decode_attention_i8(_I8_ISA, threads(), q.reshape(hq, d).contiguous().numpy(),
                                                k.codes.numpy(), v.codes.numpy(), k.scales.numpy(),
                                                v.scales.numpy(), scale, out)
            return torch.from_numpy(out).view(1, hq * d)
        return torch_attention(q, k.dequantize(), v.dequantize(), start, scale)
    if q.shape[0] == 1 and q.device.type == "cpu" and k_cache.dtype in _DECODE_KERNELS:
        k, v = k_cache[:, :end], v_cache[:, :end]
        if _rows_contiguous(k, v):
            hq, d = q.shape[1], q.shape[2]
            out = np.empty((hq, d), np.float32)
            qs = q.reshape(hq, d).contiguous().numpy()
            if k.dtype == torch.bfloat16:  # handed over as their bit patterns
                k, v = k.view(torch.uint16), v.view(torch.uint16)
            _DECODE_KERNELS[k_cache.dtype](_ISA, threads(), qs, k.numpy(), v.numpy(), scale, out)
            return torch.from_numpy(out).view(1, hq * d)
    return torch_attention(q, k_cache, v_cache, start, scale)


def _rows_contiguous(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                    scale: float) -> torch.Tensor:
    """Causal GQA attention of T new queries at positions start..start+T-1 over cache[:start+T], in torch.

    The query heads of one KV head are folded into the query rows, so keys and values are read in place,
    never repeated per query head (at 32k tokens that copy would cost more than the attention).

    Args:
        q: [T, Hq, D]; k_cache, v_cache: [Hkv, S, D] (head-major, as the KV cache returns them), holding
            the keys/values up to start+T.
    Returns:
        [T, Hq * D]
    """
    t, hq, d = q.shape
    end = start + t
    hkv = k_cache.shape[0]
    rep = hq // hkv  # query head j reads KV head j // rep
    k, v = k_cache[:, :end].to(q.dtype), v_cache[:, :end].to(q.dtype)  # a bf16 cache is widened here
    qh = q.reshape(t, hkv, rep, d).permute(1, 2, 0, 3).reshape(hkv, rep * t, d)  # rows: (r, t)
    if t == 1:  # decode sees every key; plain matmuls read the cache at 2x torch's fused CPU kernel here
        out = torch.softmax((qh @ k.transpose(1, 2)) * scale, dim=-1) @ v
    else:  # query i sees keys 0..start+i
        mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start).repeat(rep, 1)
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)  # [Hkv, rep*T, D]
    return out.reshape(hkv, rep, t, d).permute(2, 0, 1, 3).reshape(t, hq * d)
