"""Assemble and take apart one expert record (vault_format.md §4) from its quantised planes."""

from __future__ import annotations

import torch

from .format import LOW_BIT_TYPES, PROJECTIONS, QuantType, RecordLayout, projection_shape, record_layout
from .quant import SCALE_TORCH_DTYPES, dequantize_fp8, dequantize_low_bit, dequantize_mxfp4, dequantize_q4, widen_to_q4

Planes = dict[str, tuple[torch.Tensor, torch.Tensor]]  # projection -> (codes uint8, scales)
Biases = dict[str, torch.Tensor]  # projection -> float32 [rows], in a record whose layout has bias


def pack_record(layout: RecordLayout, planes: Planes, biases: Biases | None = None) -> bytearray:
    """The record's bytes, record_bytes long, every gap and the page tail zero. biases: exactly when the
    layout has bias planes."""
    if layout.bias != (biases is not None):
        raise ValueError("expert biases given for a layout without bias planes, or missing for one with them")
    out = bytearray(layout.record_bytes)
    planes_out = memoryview(out)
    scale_dtype = SCALE_TORCH_DTYPES[layout.scale_dtype]
    for proj in PROJECTIONS:
        codes, scales = planes[proj]
        parts = [("codes", codes, torch.uint8), ("scales", scales, scale_dtype)]
        if biases is not None:
            parts.append(("bias", biases[proj].reshape(1, -1), torch.float32))
        for kind, tensor, dtype in parts:
            plane = layout.plane(proj, kind)
            if tensor.dtype != dtype or tuple(tensor.shape) != plane.shape:
                raise ValueError(f"{proj} {kind}: got {tensor.dtype} {tuple(tensor.shape)}, "
                                 f"layout wants {dtype} {plane.shape}")
            raw = tensor.contiguous().view(torch.uint8).numpy().reshape(-1)
            planes_out[plane.offset:plane.offset + plane.nbytes] = raw
    return out


def unpack_record(layout: RecordLayout, record) -> Planes:
    """The planes of a record buffer (bytes, bytearray or memoryview of record_bytes), copied once."""
    if len(record) < layout.payload_bytes:
        raise ValueError(f"record has {len(record)} bytes, layout needs {layout.payload_bytes}")
    return record_planes(layout, torch.frombuffer(bytearray(record[:layout.payload_bytes]), dtype=torch.uint8))


def record_planes(layout: RecordLayout, buf: torch.Tensor) -> Planes:
    """Views (no copy) of the planes of a record held in a uint8 tensor on any device (a VRAM cache slot)."""
    scale_dtype = SCALE_TORCH_DTYPES[layout.scale_dtype]
    planes = {}
    for proj in PROJECTIONS:
        c, s = layout.plane(proj, "codes"), layout.plane(proj, "scales")
        codes = buf[c.offset:c.offset + c.nbytes].view(c.shape)
        scales = buf[s.offset:s.offset + s.nbytes].view(scale_dtype).view(s.shape)
        planes[proj] = (codes, scales)
    return planes


def record_biases(layout: RecordLayout, record) -> Biases | None:
    """The float32 biases of a record (copies), or None when its layout has none."""
    if not layout.bias:
        return None
    buf = record if isinstance(record, torch.Tensor) else torch.frombuffer(bytearray(record[:layout.payload_bytes]),
                                                                           dtype=torch.uint8)
    out = {}
    for proj in PROJECTIONS:
        b = layout.plane(proj, "bias")
        out[proj] = buf[b.offset:b.offset + b.nbytes].view(torch.float32).clone()
    return out


def dequantize_record(layout: RecordLayout, record) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) in float32, on the device of `record` when it is a uint8 tensor
    (a device cache slot), else on the CPU."""
    planes = record_planes(layout, record) if isinstance(record, torch.Tensor) else unpack_record(layout, record)
    out = []
    for proj in PROJECTIONS:
        codes, scales = planes[proj]
        _, cols = projection_shape(proj, layout.hidden, layout.intermediate)
        if layout.quant is QuantType.Q4_G32:
            out.append(dequantize_q4(codes, scales, cols))
        elif layout.quant is QuantType.MXFP4_G32:
            out.append(dequantize_mxfp4(codes, scales, cols))
        elif layout.quant in LOW_BIT_TYPES:
            out.append(dequantize_low_bit(codes, scales, cols, layout.quant))
        else:
            out.append(dequantize_fp8(codes, scales))
    return tuple(out)


def widen_record(stored: RecordLayout, record) -> bytearray:
    """A Q3_G32 or Q2_G32 record as the Q4_G32 record of the same weights (what the ring's I/O threads
    make of it natively, native/src/record_widen.cpp): the reference."""
    planes = unpack_record(stored, record)
    wide = record_layout(QuantType.Q4_G32, stored.scale_dtype, stored.hidden, stored.intermediate)
    return pack_record(wide, {p: (widen_to_q4(c, stored.quant), s) for p, (c, s) in planes.items()})
