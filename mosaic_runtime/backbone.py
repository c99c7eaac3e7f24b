"""Backbone precision at load time: the file stays bf16; `Engine.open(backbone="int8" | "fp8" | "q4")`
quantises the big projections once and runs them through the native kernels: int8 and fp8 with one
symmetric scale per output row (float activations, exact widening); q4 in the vault's own Q4_G32 layout
(a scale per 32 weights), through the expert kernels' Q4 matvec (int8 activations on AVX-512 VNNI or
AVX2), for a quarter of bf16's bytes, with lm_head in int8: the logits move most with its rounding (on
the bundled model it halves q4's perplexity cost, +0.29 % against +0.59 %), as llama.cpp's Q4_0 keeps
its output matrix at 6 bits.

Quantised: attention and DeltaNet projections, dense MLPs, shared experts and lm_head. Kept as stored:
the embedding (a lookup), router gates and the shared-expert gate (routing is where a small error
changes which experts run), norms and other vectors. Latent attention's kv_b_proj is kept here and
quantised by the model once split into the halves it multiplies by (models/weights.split_latent_kv).

load_backbone quantises tensor by tensor as it reads the file, so a backbone that does not fit in memory
as bf16 (DeepSeek-V3's 36 GB) loads in the memory its quantised form takes, plus one tensor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Collection, Iterable

import torch
from safetensors import safe_open

from .memory import HUGE_PAGES, HugePageArena
from .vault.format import Q4_BLOCK, Q4_BLOCK_BYTES
from .vault.quant import dequantize_q4, quantize_q4

BACKBONE_MODES = ("bf16", "int8", "fp8", "q4")
FP8_MAX = 448.0  # largest finite E4M3 value
_QUANTISED = re.compile(r"(self_attn\.([qkvo]_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa)|"
                        r"linear_attn\.(in_proj_\w+|out_proj)|mlp\.(gate|up|down)_proj|"
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


ROW_CHUNK_BYTES = 64 << 20  # float32 working copies of a matrix are made this many bytes of rows at a time


def quantize_matrix(w: torch.Tensor, mode: str) -> QuantizedMatrix | Q4Matrix:
    """Per output row: int8 with scale amax/127, or E4M3 with scale amax/448 (round to nearest); or Q4_G32
    as the vault stores experts (a scale per 32 weights). Rows go in chunks, so quantising DeepSeek-V3's
    lm_head (926 M weights) makes no float32 copy of all of it."""
    if mode == "q4":
        codes, scales = quantize_q4(w)
        return Q4Matrix(codes, scales, w.shape[1])
    if mode not in ("int8", "fp8"):
        raise ValueError(f"quantize_matrix: mode must be 'int8', 'fp8' or 'q4', not {mode!r}")
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scales = torch.empty(rows, dtype=torch.float32)
    step = max(1, ROW_CHUNK_BYTES // (4 * max(cols, 1)))
    for r0 in range(0, rows, step):
        part = w[r0:r0 + step].float()
        amax = part.abs().amax(dim=1).clamp_min(1e-30)
        if mode == "int8":
            s = amax / 127.0
            codes[r0:r0 + step] = torch.round(part / s[:, None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            s = amax / FP8_MAX
            codes[r0:r0 + step] = (part / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        scales[r0:r0 + step] = s
    return QuantizedMatrix(codes, scales, fp8=mode == "fp8")


def _mode_of(name: str, mode: str, dims: int) -> str | None:
    """What a backbone tensor becomes under a backbone mode: None (kept as stored), int8, fp8 or q4."""
    if mode == "bf16" or dims != 2 or not _QUANTISED.search(name):
        return None
    return "int8" if mode == "q4" and name == "lm_head.weight" else mode


# Latent attention's kv_b_proj, which the model splits in two halves quantised under the mode
# (models/weights.split_latent_kv): counted as one matrix of its shape, a few hundred KB a layer from exact.
_SPLIT = re.compile(r"self_attn\.kv_b_proj\.weight$")


def held_bytes(name: str, shape: tuple[int, ...], itemsize: int, mode: str) -> int:
    """Bytes a backbone tensor takes in memory under a mode (what prepare_backbone, and the model's split
    of kv_b_proj, make of it), from its name and shape alone."""
    as_stored = itemsize * math.prod(shape)
    held = _mode_of(name, mode, len(shape))
    if held is None and mode != "bf16" and len(shape) == 2 and _SPLIT.search(name):
        held = mode
    if held is None:
        return as_stored
    rows, cols = shape
    if held == "q4":
        return rows * -(-cols // Q4_BLOCK) * (Q4_BLOCK_BYTES + 2)  # codes, and an f16 scale a block
    return rows * cols + 4 * rows  # int8 / E4M3 codes and a float32 scale a row


def resident_bytes(tensors: dict[str, tuple[tuple[int, ...], int]], mode: str, tie_word_embeddings: bool) -> int:
    """What a backbone of tensors {name: (shape, itemsize)} takes in memory under a mode."""
    total = sum(held_bytes(name, shape, itemsize, mode) for name, (shape, itemsize) in tensors.items())
    if tie_word_embeddings and mode != "bf16" and "lm_head.weight" not in tensors:  # its own quantised copy
        shape, itemsize = tensors["model.embed_tokens.weight"]
        total += held_bytes("lm_head.weight", shape, itemsize, mode)
    return total


def prepare_backbone(weights: dict[str, torch.Tensor], mode: str, tie_word_embeddings: bool) -> dict:
    """The backbone as the model should hold it: bf16 as stored, or its projections quantised."""
    return _prepared(weights.items(), weights.keys(), mode, tie_word_embeddings)


def _prepared(tensors: Iterable[tuple[str, torch.Tensor]], names: Collection[str], mode: str,
              tie_word_embeddings: bool) -> dict:
    """prepare_backbone of (name, tensor) pairs taken one at a time, each quantised before the next is taken."""
    if mode not in BACKBONE_MODES:
        raise ValueError(f"backbone must be one of {BACKBONE_MODES}, not {mode!r}")
    out = {}
    for name, w in tensors:
        held = _mode_of(name, mode, w.dim())
        out[name] = w if held is None else quantize_matrix(w, held)
        if tie_word_embeddings and mode != "bf16" and name == "model.embed_tokens.weight" \
                and "lm_head.weight" not in names:  # the head gets its own quantised copy
            out["lm_head.weight"] = quantize_matrix(w, _mode_of("lm_head.weight", mode, 2))
    return out


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U8": 1, "BOOL": 1}  # every dtype a backbone file may hold (integer tensors pass through)


def file_tensors(path) -> dict[str, tuple[tuple[int, ...], int]]:
    """{name: (shape, itemsize)} of a backbone file, from its header (no tensor is read)."""
    with safe_open(str(path), framework="pt") as f:
        return {name: (tuple(f.get_slice(name).get_shape()), _ITEMSIZE[f.get_slice(name).get_dtype()])
                for name in f.keys()}


def load_backbone(path, mode: str, tie_word_embeddings: bool) -> dict:
    """prepare_backbone of a backbone file, read one tensor at a time: each is quantised before the next is
    read, so loading never holds the whole file as stored."""
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        return _prepared(((name, f.get_tensor(name)) for name in names), names, mode, tie_word_embeddings)


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
