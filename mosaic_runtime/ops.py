"""Backbone projections: y = x @ W.T for float32 activations and weights kept as stored (bf16), or
quantised at load (backbone.QuantizedMatrix: int8 or FP8 codes with a scale per row).

The native kernels widen bf16, int8 and E4M3 to float32 inside the dot product (exact), so weights stay
compact in memory and are read at 2 or 1 bytes a weight; tests/test_kernels.py holds them against the
float product.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import numpy as np
import torch
import torch.nn.functional as F

from . import _native
from .backbone import Q4Matrix, QuantizedMatrix

_K = _native.kernels
_ISA = _K.best_isa()
# A Q4 backbone is lossy already: it takes the int8-activation kernel where there is one (AVX-512 VNNI:
# 0.8-0.9 of the memory roofline against 0.3 for the float Q4 loop, benchmarks/RESULTS.md; or AVX2).
_INT8 = _K.int8_isa()
Q4_ISA = _ISA if _INT8 is None else _INT8

def flush_subnormals() -> None:
    """Read and write floats below float32's normal range (1.2e-38) as zero on this thread and on the threads
    it starts from now on, torch's OpenMP workers among them (a thread inherits its creator's setting).

    A DeltaNet layer's delta rule multiplies its state by exp() of log-decays (in the torch chunked form,
    summed over up to 64 tokens); with strong decays (a Qwen3.5-geometry model's reach -91 in a chunk) values
    fall below that range, and x86 takes a microcode assist for every multiply that reads or writes such a
    value: at 512 tokens the chunked rule ran 73 ms a layer where it ran 33 with them flushed on every thread
    (295 against 33 with stronger decays). Values that
    small change no sum at float32's precision. Called when this module is imported, before torch's workers
    exist on the importing thread, and again by using_threads on any thread that runs a forward pass."""
    torch.set_flush_denormal(True)


flush_subnormals()

# Per context, not per process: each Engine runs its forward passes under its own setting (using_threads),
# so two engines in one process, or in two threads, keep theirs.
_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("mosaic_threads", default=os.cpu_count() or 1)


@contextlib.contextmanager
def using_threads(n: int):
    """Run the native kernels (and torch's ops) called inside on n threads, subnormal floats flushed to zero
    on the calling thread (flush_subnormals)."""
    token = _THREADS.set(n)
    flush_subnormals()
    if torch.get_num_threads() != n:  # torch's own setting is per process: taken again when another changed it
        torch.set_num_threads(n)
    try:
        yield
    finally:
        _THREADS.reset(token)


def threads() -> int:
    """Threads the native backbone kernels use (the running Engine's, using_threads)."""
    return _THREADS.get()


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [T, in] float32, w [out, in] bf16, float32, a QuantizedMatrix or a Q4Matrix -> [T, out] float32."""
    if isinstance(w, Q4Matrix):
        xs = x.contiguous()
        y = np.empty((xs.shape[0], w.shape[0]), np.float32)
        _K.linear_q4(Q4_ISA, threads(), w.codes.numpy(), w.scales.view(torch.uint16).numpy(), xs.numpy(), y)
        return torch.from_numpy(y)
    if isinstance(w, QuantizedMatrix):
        xs = x.contiguous()
        y = np.empty((xs.shape[0], w.shape[0]), np.float32)
        _K.linear_quant(_ISA, threads(), w.codes.numpy(), w.scales.numpy(), w.fp8, xs.numpy(), y)
        return torch.from_numpy(y)
    if w.device.type != "cpu":  # a backbone in VRAM: bf16 activations, float32 accumulation (cuBLAS)
        return F.linear(x.to(w.dtype), w).float()
    if w.dtype != torch.bfloat16:
        return F.linear(x, w)
    xs = x.contiguous()
    y = np.empty((xs.shape[0], w.shape[0]), np.float32)
    _K.linear_bf16(_ISA, threads(), w.view(torch.uint16).numpy(), xs.numpy(), y)
    return torch.from_numpy(y)
