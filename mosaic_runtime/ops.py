"""Backbone projections: y = x @ W.T for float32 activations and weights kept as stored (bf16).

The native kernel widens bf16 to float32 inside the dot product (exact), so the backbone stays bf16 in
memory and is read at 2 bytes a weight; tests/test_kernels.py holds it against the float product.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from . import _native

_K = _native.kernels
_ISA = _K.best_isa()

_THREADS = [os.cpu_count() or 1]


def set_threads(n: int) -> None:
    _THREADS[0] = n


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, in] float32, w [out, in] bf16 or float32 -> [T, out] float32."""
    if w.dtype != torch.bfloat16:
        return F.linear(x, w)
    xs = x.contiguous()
    y = np.empty((xs.shape[0], w.shape[0]), np.float32)
    _K.linear_bf16(_ISA, _THREADS[0], w.view(torch.uint16).numpy(), xs.numpy(), y)
    return torch.from_numpy(y)
