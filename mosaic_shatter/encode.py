"""Read one expert's three projections from the checkpoint and encode them as one vault record."""

from __future__ import annotations

import torch

from mosaic_runtime.vault.format import PROJECTIONS, QuantType, RecordLayout
from mosaic_runtime.vault.quant import dequantize_fp8, quantize_fp8, quantize_q4
from mosaic_runtime.vault.record import pack_record

from . import int4_source
from .checkpoint import Checkpoint
from .plan import ProjectionSource


def encode_expert(ckpt: Checkpoint, sources: dict[str, ProjectionSource], layout: RecordLayout,
                  passthrough: bool) -> bytearray:
    """The record bytes of one expert.

    Args:
        passthrough: the source's codes go into the vault as they are, never re-quantised: an FP8 source
            with the same 128 x 128 blocks into an FP8 vault (codes and scales bit for bit), or packed
            int4 in groups of 32 into a Q4 vault (int4_source.as_q4).
    """
    planes = {}
    for proj in PROJECTIONS:
        src = sources[proj]
        weight = ckpt.read(src.tensor, src.index)  # [rows, cols] as nn.Linear stores it
        int4 = src.tensor.endswith(int4_source.PACKED)
        if passthrough:
            scale = ckpt.read(src.scale).contiguous()
            planes[proj] = int4_source.as_q4(weight, scale) if int4 else (weight.view(torch.uint8).contiguous(), scale)
            continue
        if int4:
            weight = int4_source.dequantize(weight, ckpt.read(src.scale))
        elif src.scale is not None:
            weight = dequantize_fp8(weight, ckpt.read(src.scale))
        # one thread a projection: convert runs experts on several workers already; bf16 goes to the
        # encoders as stored
        quantize = quantize_q4 if layout.quant is QuantType.Q4_G32 else quantize_fp8
        planes[proj] = quantize(weight, threads=1)
    return pack_record(layout, planes)
