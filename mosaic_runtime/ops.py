"""Backbone projections: y = x @ W.T for float32 activations and weights kept as stored (bf16), or
quantised at load (backbone.QuantizedMatrix: int8 or FP8 codes with a scale per row).

The native kernels widen bf16, int8 and E4M3 to float32 inside the dot product (exact), so weights stay
compact in memory and are read at 2 or 1 bytes a weight; tests/test_kernels.py holds them against the
float product.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from . import _native
from .backbone import QuantizedMatrix

_K = _native.kernels
_ISA = _K.best_isa()

_THREADS = [os.cpu_count() or 1]


def set_threads(n: int) -> None:
    _THREADS[0] = n


def threads() -> int:
    """Threads the native backbone kernels use (set by Engine.open)."""
    return _THREADS[0]


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [T, in] float32, w [out, in] bf16, float32 or a QuantizedMatrix -> [T, out] float32."""
    if isinstance(w, QuantizedMatrix):
        xs = x.contiguous()
        y = np.empty((xs.shape[0], w.shape[0]), np.float32)
        _K.linear_quant(_ISA, _THREADS[0], w.codes.numpy(), w.scales.numpy(), w.fp8, xs.numpy(), y)
        return torch.from_numpy(y)
    if w.device.type != "cpu":  # a backbone in VRAM: bf16 activations, float32 accumulation (cuBLAS)
        return F.linear(x.to(w.dtype), w).float()
    if w.dtype != torch.bfloat16:
        return F.linear(x, w)
    xs = x.contiguous()
    y = np.empty((xs.shape[0], w.shape[0]), np.float32)
    _K.linear_bf16(_ISA, _THREADS[0], w.view(torch.uint16).numpy(), xs.numpy(), y)
    return torch.from_numpy(y)
