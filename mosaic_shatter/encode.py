"""Read one expert's three projections from the checkpoint and encode them as one vault record."""

from __future__ import annotations

import torch

from mosaic_runtime.vault.format import PROJECTIONS, QuantType, RecordLayout
from mosaic_runtime.vault.quant import dequantize_fp8, quantize_fp8, quantize_q4
from mosaic_runtime.vault.record import pack_record

from .checkpoint import Checkpoint
from .plan import ProjectionSource


def encode_expert(ckpt: Checkpoint, sources: dict[str, ProjectionSource], layout: RecordLayout,
                  passthrough: bool) -> bytearray:
    """The record bytes of one expert.

    Args:
        passthrough: FP8 source and FP8 vault with the same 128 x 128 blocks: codes and scales are
            copied bit for bit, never re-quantised.
    """
    planes = {}
    for proj in PROJECTIONS:
        src = sources[proj]
        weight = ckpt.read(src.tensor, src.index)  # [rows, cols] as nn.Linear stores it
        if passthrough:
            planes[proj] = (weight.view(torch.uint8).contiguous(), ckpt.read(src.scale).contiguous())
            continue
        if src.scale is not None:
            weight = dequantize_fp8(weight, ckpt.read(src.scale))
        quantize = quantize_q4 if layout.quant is QuantType.Q4_G32 else quantize_fp8
        planes[proj] = quantize(weight.float())
    return pack_record(layout, planes)
