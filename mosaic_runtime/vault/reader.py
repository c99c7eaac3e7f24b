"""Open and validate a converted model directory; locate, read and dequantise expert records."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .format import (BACKBONE_FILE, HEADER_SIZE, QUANT_NAMES, VAULT_FILE, IndexEntry, RecordLayout, Reason,
                     VaultError, VaultHeader, crc32, decode_meta, file_sha256, moe_layers_of, unpack_index)
from .record import dequantize_record, record_biases, widen_record

try:  # reading needs no compiled extension, but widens low-bit records natively where it is built
    from .._native import io as _native_io
except ImportError:
    _native_io = None

QUANT_LABELS = {q: name for name, q in QUANT_NAMES.items()}
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class Vault:
    """A validated vault. Opening reads only the header, the metadata and the index."""

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        if directory.is_file() and directory.name == VAULT_FILE:
            directory = directory.parent
        self.directory = directory
        self.path = directory / VAULT_FILE
        self.backbone_path = directory / BACKBONE_FILE
        for p in (self.path, self.backbone_path):
            if not p.is_file():
                raise VaultError(Reason.MISSING_FILE, f"{p.name} not found in {directory}", path=str(p))
        self._file = open(self.path, "rb", buffering=0)
        try:
            self._load()
        except BaseException:
            self._file.close()
            raise

    def _load(self) -> None:
        where = str(self.path)
        actual = os.fstat(self._file.fileno()).st_size
        header = VaultHeader.unpack(self._pread(0, min(HEADER_SIZE, actual)), path=where)
        if actual < header.file_size:
            raise VaultError(Reason.TRUNCATED, f"file is {actual} bytes, header says {header.file_size}", path=where,
                             offset=actual)
        if actual > header.file_size:
            raise VaultError(Reason.BAD_HEADER, f"file is {actual} bytes, header says {header.file_size}", path=where,
                             offset=112)
        meta = self._pread(header.arch_offset, header.data_offset - header.arch_offset)
        if crc32(meta) != header.meta_crc32:
            raise VaultError(Reason.BAD_CHECKSUM, "arch/lineage/index CRC-32 does not match", path=where,
                             offset=header.arch_offset)
        rel = lambda off: off - header.arch_offset  # noqa: E731
        self.arch = decode_meta(meta[:header.arch_length], "arch", path=where, offset=header.arch_offset)
        self.lineage = decode_meta(meta[rel(header.lineage_offset):rel(header.lineage_offset) + header.lineage_length],
                                   "lineage", path=where, offset=header.lineage_offset)
        moe_layers = moe_layers_of(self.arch, path=where)
        for field, value in (("num_experts", header.num_experts), ("hidden_size", header.hidden),
                             ("moe_intermediate_size", header.intermediate)):
            if self.arch[field] != value:
                raise VaultError(Reason.BAD_METADATA, f"arch {field} = {self.arch[field]}, header says {value}",
                                 path=where)
        if self.arch["num_hidden_layers"] != header.num_layers:
            raise VaultError(Reason.BAD_METADATA, "arch num_hidden_layers disagrees with the header", path=where)
        raw_index = meta[rel(header.index_offset):rel(header.index_offset) + header.index_length]
        self.header = header
        self.layout = header.layout
        self.entries: dict[tuple[int, int], IndexEntry] = {
            (e.layer, e.expert): e for e in unpack_index(raw_index, header, moe_layers, path=where)}
        self.moe_layers = moe_layers

    # --- public API ---------------------------------------------------------------------------
    @property
    def quant(self) -> str:
        return QUANT_LABELS[self.header.quant]

    def entry(self, layer: int, expert: int) -> IndexEntry:
        try:
            return self.entries[(layer, expert)]
        except KeyError:
            raise KeyError(f"no expert record for layer {layer}, expert {expert} in {self.path}") from None

    def read_record(self, layer: int, expert: int, *, check: bool = True) -> bytes:
        """The raw record bytes; with check, its CRC-32 is verified first."""
        e = self.entry(layer, expert)
        raw = self._pread(e.offset, e.length)
        if check and crc32(raw) != e.crc32:
            raise VaultError(Reason.BAD_CHECKSUM, "expert record CRC-32 does not match", path=str(self.path),
                             offset=e.offset, layer=layer, expert=expert)
        return raw

    def stored_layout(self, layer: int, expert: int) -> RecordLayout:
        """The layout of the record as stored: the vault's own, or in a per-record vault the record's type's."""
        return self.header.stored_layout(self.entry(layer, expert).stored_quant(self.header))

    @property
    def record_quants(self) -> dict[str, int]:
        """How many records are stored as each quant type ({"Q4_G32": 6144} in a uniform Q4 vault)."""
        counts: dict[str, int] = {}
        for e in self.entries.values():
            name = e.stored_quant(self.header).name
            counts[name] = counts.get(name, 0) + 1
        return counts

    def read_compute_record(self, layer: int, expert: int) -> bytes | bytearray:
        """The record in the vault's compute layout (`layout`), CRC-checked: a low-bit record widened to Q4_G32
        exactly as the ring widens it, any other as stored."""
        raw = self.read_record(layer, expert)
        stored = self.stored_layout(layer, expert)
        if stored.quant is self.layout.quant:
            return raw
        if _native_io is None:
            return widen_record(stored, raw)
        out = bytearray(self.layout.record_bytes)
        out[:len(raw)] = raw
        _native_io.widen_record(memoryview(out), int(stored.quant), self.header.hidden, self.header.intermediate)
        return out

    def dequantize_expert(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [I, H], up [I, H], down [H, I]) as float32 tensors, from the record as stored."""
        return dequantize_record(self.stored_layout(layer, expert), self.read_record(layer, expert))

    def expert_biases(self, layer: int, expert: int) -> dict[str, torch.Tensor] | None:
        """The expert's float32 biases by projection, or None when the vault's records carry none."""
        return record_biases(self.layout, self.read_record(layer, expert)) if self.layout.bias else None

    def backbone_header(self) -> dict:
        """The backbone's safetensors header, checked against the file size."""
        where = str(self.backbone_path)
        with open(self.backbone_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise VaultError(Reason.TRUNCATED, "backbone shorter than its 8-byte header length", path=where)
            (n,) = struct.unpack("<Q", head)
            if n > min(_SAFETENSORS_MAX_HEADER, size - 8):
                raise VaultError(Reason.TRUNCATED, f"backbone header length {n} exceeds the file", path=where, offset=0)
            try:
                meta = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise VaultError(Reason.BAD_METADATA, f"backbone header is not JSON: {e}", path=where, offset=8) from None
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            raise VaultError(Reason.TRUNCATED if 8 + n + end > size else Reason.BAD_HEADER,
                             f"backbone data ends at {8 + n + end}, file is {size} bytes", path=where)
        return meta

    def _check_copy(self, name: str, want: dict) -> VaultError | None:
        """A file of the model directory against the size and SHA-256 the lineage block records."""
        path = self.directory / name
        if not path.is_file():
            return VaultError(Reason.MISSING_FILE, f"{name} is listed in the lineage block but missing", path=str(path))
        if path.stat().st_size != want.get("bytes") or file_sha256(path) != want.get("sha256"):
            return VaultError(Reason.BAD_CHECKSUM, f"{name} differs from the size or SHA-256 in the lineage block",
                              path=str(path))
        return None

    def verify(self, progress=None) -> list[VaultError]:
        """Re-read every record, the backbone and the copied config/tokenizer files; return what is wrong."""
        problems = []
        try:
            self.backbone_header()
        except VaultError as e:
            problems.append(e)
        # The backbone, and the config/tokenizer files copied verbatim from the source (weights are not copied).
        copies = [(BACKBONE_FILE, self.lineage.get("backbone", {}))]
        copies += [(f["name"], f) for f in self.lineage.get("files", []) if not f["name"].endswith(".safetensors")]
        for name, want in copies:
            if problem := self._check_copy(name, want):
                problems.append(problem)
        for (layer, expert) in self.entries:
            try:
                self.read_record(layer, expert)
            except VaultError as e:
                problems.append(e)
            if progress is not None:
                progress(self.entries[(layer, expert)].length)
        return problems

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "Vault":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self._file.fileno(), length, offset)
        if len(data) != length:
            raise VaultError(Reason.TRUNCATED, f"short read: wanted {length} bytes, got {len(data)}",
                             path=str(self.path), offset=offset)
        return data


def open_vault(path: str | os.PathLike) -> Vault:
    """Open a converted model directory (or its experts.vault file).

    Raises:
        VaultError: the directory is incomplete, or the vault is truncated, corrupted or of an
            unsupported version; the message names the file, field and offset.
    """
    return Vault(path)

