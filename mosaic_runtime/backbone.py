"""Backbone precision at load time: the file stays bf16; `Engine.open(backbone="int8" | "fp8" | "q4")`
quantises the big projections once and runs them through the native kernels: int8 and fp8 with one
symmetric scale per output row (float activations, exact widening); q4 in the vault's own Q4_G32 layout
(a scale per 32 weights), through the expert kernels' Q4 matvec (int8 activations on AVX-512 VNNI or
AVX2), for a quarter of bf16's bytes, with lm_head in int8: the logits move most with its rounding (on
the bundled model it halves q4's perplexity cost, +0.29 % against +0.59 %), as llama.cpp's Q4_0 keeps
its output matrix at 6 bits.

Quantised: attention and DeltaNet projections, dense MLPs, shared experts and lm_head. Kept as stored:
the embedding (a lookup), router gates and the shared-expert gate (routing is where a small error
changes which experts run), norms and other vectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from .memory import HUGE_PAGES, HugePageArena
from .vault.quant import dequantize_q4, quantize_q4

BACKBONE_MODES = ("bf16", "int8", "fp8", "q4")
FP8_MAX = 448.0  # largest finite E4M3 value
_QUANTISED = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_\w+|out_proj)|mlp\.(gate|up|down)_proj|"
                        r"shared_experts?\.(gate|up|down)_proj)\.weight$|^lm_head\.weight$")


@dataclass
class QuantizedMatrix:
    """W ~= codes * scales[:, None]: codes [rows, cols] as uint8 bytes (int8 or E4M3), scales float32 [rows]."""

    codes: torch.Tensor
    scales: torch.Tensor
    fp8: bool

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dim(self) -> int:
        return 2

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix this stands for (the reference for tests)."""
        values = self.codes.view(torch.float8_e4m3fn).float() if self.fp8 else self.codes.view(torch.int8).float()
        return values * self.scales[:, None]


@dataclass
class Q4Matrix:
    """W in the vault's Q4_G32 layout: codes [rows, ceil(cols/32)*16] (two 4-bit codes a byte), f16 scales
    [rows, ceil(cols/32)], one per 32 weights of a row. Run by the expert kernels' Q4 matvec."""

    codes: torch.Tensor
    scales: torch.Tensor
    cols: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.cols))

    def dim(self) -> int:
        return 2

    def dequantize(self) -> torch.Tensor:
        return dequantize_q4(self.codes, self.scales, self.cols)


def quantize_matrix(w: torch.Tensor, mode: str) -> QuantizedMatrix | Q4Matrix:
    """Per output row: int8 with scale amax/127, or E4M3 with scale amax/448 (round to nearest); or Q4_G32
    as the vault stores experts (a scale per 32 weights)."""
    w = w.float()
    if mode == "q4":
        codes, scales = quantize_q4(w)
        return Q4Matrix(codes, scales, w.shape[1])
    amax = w.abs().amax(dim=1).clamp_min(1e-30)
    if mode == "int8":
        scales = amax / 127.0
        codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return QuantizedMatrix(codes.contiguous(), scales.contiguous(), fp8=False)
    if mode == "fp8":
        scales = amax / FP8_MAX
        codes = (w / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        return QuantizedMatrix(codes.contiguous(), scales.contiguous(), fp8=True)
    raise ValueError(f"quantize_matrix: mode must be 'int8', 'fp8' or 'q4', not {mode!r}")


def prepare_backbone(weights: dict[str, torch.Tensor], mode: str, tie_word_embeddings: bool) -> dict:
    """The backbone as the model should hold it: bf16 as stored, or its projections quantised."""
    if mode not in BACKBONE_MODES:
        raise ValueError(f"backbone must be one of {BACKBONE_MODES}, not {mode!r}")
    if mode == "bf16":
        return weights
    out = dict(weights)
    if tie_word_embeddings and "lm_head.weight" not in out:  # the head gets its own quantised copy
        out["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for name, w in out.items():
        if w.dim() == 2 and _QUANTISED.search(name):
            out[name] = quantize_matrix(w, "int8" if mode == "q4" and name == "lm_head.weight" else mode)
    return out


def _arrays(w) -> dict[str, torch.Tensor]:
    """The tensors a backbone entry holds, by field name ({"": w} for a plain tensor)."""
    if isinstance(w, (QuantizedMatrix, Q4Matrix)):
        return {"codes": w.codes, "scales": w.scales}
    return {"": w}


def on_huge_pages(weights: dict) -> dict:
    """weights with every CPU tensor moved into one huge-page arena (memory.HugePageArena), in place, one
    entry at a time so the originals are freed as they go. The projections stream from memory every
    token; on 2 MiB pages they do not pay a TLB miss per 4 KiB. Unchanged where there are no huge pages
    to ask for (the arena would be zeroed memory, touched at once: two copies at the peak) or a tensor is
    not on the CPU."""
    if not HUGE_PAGES or any(t.device.type != "cpu" for w in weights.values() for t in _arrays(w).values()):
        return weights
    arena = HugePageArena(sum(HugePageArena.room(t) for w in weights.values() for t in _arrays(w).values()))
    for name in list(weights):
        w = weights[name]
        moved = {field: arena.take(t) for field, t in _arrays(w).items()}
        weights[name] = moved[""] if "" in moved else replace(w, **moved)
        del w, moved
    return weights
