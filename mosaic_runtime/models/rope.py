"""Rotary position embeddings: tables for every position, built once at start-up.

Rope kinds follow transformers' modeling_rope_utils (the reference they are tested against): default,
linear (positions divided by the factor), YaRN (frequencies blended between interpolation and
extrapolation, cos and sin scaled by the attention factor) and llama3 (low frequencies divided by the
factor, a smooth blend between). Partial RoPE rotates the first rot_dim values of each head.
"""

from __future__ import annotations

import math

import torch

from ..recipe import Rope


def inverse_frequencies(rope: Rope) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2], attention factor that scales cos and sin)."""
    dim, base, s = rope.rot_dim, rope.theta, rope.scaling or {}
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / float(s["factor"]), 1.0
    original = s.get("original_max_position_embeddings") or rope.max_position_embeddings
    if rope.kind == "llama3":
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        return torch.where(medium, blended, scaled), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, original)
    raise NotImplementedError(f"rope type {rope.kind!r} is not supported")


def _yarn(rope: Rope, original: int) -> tuple[torch.Tensor, float]:
    dim, base, s = rope.rot_dim, rope.theta, rope.scaling
    factor = s.get("factor") or rope.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # share of each frequency kept as is
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    """RoPE tables for positions 0..max_positions-1 (rotate-half convention)."""

    def __init__(self, rope: Rope, max_positions: int):
        self.rot_dim = rope.rot_dim
        inv_freq, factor = inverse_frequencies(rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, rot]
        self.cos = emb.cos() * factor
        # rotate_half(x) * sin == roll(x, rot/2) * sin with its first half negated: the same products, one
        # op instead of a slice, a negation and a concatenation.
        half = torch.ones(self.rot_dim // 2)
        self.signed_sin = emb.sin() * factor * torch.cat([-half, half])

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for positions [T], looked up once per forward pass and shared by every layer."""
        return self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]  # [T, 1, rot]

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, head_dim] rotated with tables = at(positions)."""
        cos, signed_sin = tables
        if self.rot_dim == x.shape[-1]:
            return x * cos + x.roll(self.rot_dim // 2, dims=-1) * signed_sin
        rot, rest = x[..., :self.rot_dim], x[..., self.rot_dim:]
        return torch.cat([rot * cos + rot.roll(self.rot_dim // 2, dims=-1) * signed_sin, rest], dim=-1)
