"""Stream the backbone into a safetensors file, one chunk at a time.

The safetensors library writes only from tensors held in memory; a 235B backbone is 15 GB, so this
writer lays out the (standard) safetensors header first and then fills each tensor's byte range in
chunks, keeping resident memory bounded by plan.CHUNK_BYTES whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import torch

from mosaic_runtime.vault.quant import dequantize_fp8

from . import int4_source
from .checkpoint import Checkpoint
from .plan import CHUNK_BYTES, BackboneTensor
from .write_vault import pwrite_all, reserve

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                 "I32": torch.int32}
_FP8_BLOCK_ROWS = 128


def _header(tensors: list[BackboneTensor], metadata: dict[str, str]) -> bytes:
    meta: dict = {"__metadata__": metadata}
    at = 0
    for t in tensors:
        meta[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # safetensors pads the header with spaces to 8-byte alignment
    return struct.pack("<Q", len(raw)) + raw


def _row_chunks(rows: int, row_bytes: int, multiple: int = 1):
    step = max(multiple, (CHUNK_BYTES // max(row_bytes, 1)) // multiple * multiple)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


class _HashingWriter:
    """Writes strictly in file order, so the SHA-256 of the finished file is known without a re-read."""

    def __init__(self, fd: int, at: int):
        self.fd, self.at, self.sha = fd, at, hashlib.sha256()

    def write(self, data) -> None:
        pwrite_all(self.fd, data, self.at)
        self.sha.update(data)
        self.at += len(data)


def _write_tensor(ckpt: Checkpoint, t: BackboneTensor, out: _HashingWriter) -> None:
    src = t.source
    if src.dtype == t.dtype:  # same dtype: copy the bytes, bit for bit, without holding them
        with open(src.file, "rb") as f:
            done = 0
            while done < src.nbytes:
                chunk = os.pread(f.fileno(), min(CHUNK_BYTES, src.nbytes - done), src.begin + done)
                if not chunk:
                    raise OSError(f"{src.file}: short read in {src.name}")
                out.write(chunk)
                done += len(chunk)
        return
    if not t.shape:  # a scalar: small, converted whole
        out.write(ckpt.read(src.name).to(_TORCH_DTYPES[t.dtype]).reshape(1).view(torch.uint8).numpy().tobytes())
        return
    rows = t.shape[0]
    row_elems = math.prod(t.shape) // rows
    out_dtype = _TORCH_DTYPES[t.dtype]
    int4 = src.name.endswith(int4_source.PACKED)
    for r0, r1 in _row_chunks(rows, row_elems * 4, _FP8_BLOCK_ROWS if t.scale and not int4 else 1):
        values = ckpt.read(src.name, (slice(r0, r1),))
        if int4:  # packed int4 -> float with the rows' group scales
            values = int4_source.dequantize(values, ckpt.read(t.scale, (slice(r0, r1),)))
        elif t.scale:  # block FP8 -> float with the scale rows covering rows [r0, r1)
            scale = ckpt.read(t.scale, (slice(r0 // _FP8_BLOCK_ROWS, -(-r1 // _FP8_BLOCK_ROWS)),))
            values = dequantize_fp8(values, scale)
        out.write(values.to(out_dtype).contiguous().view(torch.uint8).numpy().tobytes())


def write_backbone(ckpt: Checkpoint, tensors: list[BackboneTensor], path, metadata: dict[str, str],
                   progress=None) -> tuple[int, str]:
    """Write every backbone tensor to `path`; returns (file size, SHA-256 of the file).

    Raises:
        DiskFull: the file's space could not be reserved up front.
    """
    header = _header(tensors, metadata)
    total = len(header) + sum(t.nbytes for t in tensors)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        reserve(fd, total, path)
        out = _HashingWriter(fd, 0)
        out.write(header)
        for t in tensors:
            _write_tensor(ckpt, t, out)
            if progress is not None:
                progress(t.source.nbytes)
        if out.at != total:
            raise RuntimeError(f"backbone: wrote {out.at} bytes, planned {total}")
        os.fsync(fd)
    finally:
        os.close(fd)
    return total, out.sha.hexdigest()
