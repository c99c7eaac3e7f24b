"""Read one expert's three projections from the checkpoint and encode them as one vault record."""

from __future__ import annotations

import torch

from mosaic_runtime.vault.format import PROJECTIONS, QuantType, RecordLayout, projection_shape
from mosaic_runtime.vault.quant import (dequantize_fp8, dequantize_mxfp4, quantize_fp8, quantize_low_bit,
                                        quantize_mxfp4, quantize_q4)
from mosaic_runtime.vault.record import pack_record

from . import int4_source, mxfp4_source
from .checkpoint import Checkpoint
from .plan import ProjectionSource

# one thread a projection: convert runs experts on several workers already
_QUANTIZE = {QuantType.Q4_G32: lambda w: quantize_q4(w, threads=1),
             QuantType.FP8_B128: lambda w: quantize_fp8(w, threads=1),
             QuantType.MXFP4_G32: quantize_mxfp4,
             QuantType.Q3_G32: lambda w: quantize_low_bit(w, QuantType.Q3_G32),
             QuantType.Q2_G32: lambda w: quantize_low_bit(w, QuantType.Q2_G32)}


def will_need(ckpt: Checkpoint, sources: dict[str, ProjectionSource]) -> None:
    """Start the disk on what encode_expert(ckpt, sources, ...) will read: its weights and biases (the scales
    are small). Each byte range once: gate and up may share one interleaved tensor."""
    spans = {(src.tensor, repr(src.index)): (src.tensor, src.index) for src in sources.values()}
    spans |= {(src.bias, repr(src.index)): (src.bias, src.index) for src in sources.values() if src.bias}
    for name, index in spans.values():
        ckpt.will_need(name, index)


def encode_expert(ckpt: Checkpoint, sources: dict[str, ProjectionSource], layout: RecordLayout,
                  passthrough: bool) -> bytearray:
    """The record bytes of one expert.

    Args:
        passthrough: the source's codes go into the vault as they are, never re-quantised: an FP8 source
            with the same 128 x 128 blocks into an FP8 vault (codes and scales bit for bit), packed int4 in
            groups of 32 into a Q4 vault (int4_source.as_q4), MXFP4 blocks into an MXFP4 vault.
    """
    reads: dict[tuple[str, str], torch.Tensor] = {}

    def read(name: str, index: tuple) -> torch.Tensor:  # gate and up may share one interleaved read
        key = (name, repr(index))  # slices are not hashable before Python 3.12
        if key not in reads:
            reads[key] = ckpt.read(name, index)
        return reads[key]

    planes, biases = {}, {}
    for proj in PROJECTIONS:
        src = sources[proj]
        rows = src.rows if src.rows is not None else slice(None)
        if src.bias is not None:
            biases[proj] = read(src.bias, src.index)[rows].float()
        if src.tensor.endswith(mxfp4_source.BLOCKS):
            codes, scales = mxfp4_source.as_planes(read(src.tensor, src.index)[rows], read(src.scale, src.index)[rows])
            if passthrough:
                planes[proj] = codes, scales
                continue
            weight = dequantize_mxfp4(codes, scales, projection_shape(proj, layout.hidden, layout.intermediate)[1])
        else:
            weight = read(src.tensor, src.index)  # [rows, cols] as nn.Linear stores it, or [cols, rows]
            if src.transposed:
                weight = weight.T
            weight = weight[rows]
            int4 = src.tensor.endswith(int4_source.PACKED)
            if passthrough:
                scale = ckpt.read(src.scale).contiguous()
                planes[proj] = int4_source.as_q4(weight, scale) if int4 else (weight.view(torch.uint8).contiguous(),
                                                                              scale)
                continue
            if int4:
                weight = int4_source.dequantize(weight, ckpt.read(src.scale))
            elif src.scale is not None:
                weight = dequantize_fp8(weight, ckpt.read(src.scale))
        # bf16 goes to the encoders as stored (a strided view is copied once there)
        planes[proj] = _QUANTIZE[layout.quant](weight.contiguous())
    return pack_record(layout, planes, biases if layout.bias else None)
