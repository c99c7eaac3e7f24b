"""The one Python codec of the vault byte layout (vault_format.md is the normative text).

Everything about bytes lives here: constants, the fixed header, index entries, the in-record plane
layout and the rules a reader must enforce. Writers and readers import this module; nothing else
computes an offset or a padding.
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass

# --- constants (vault_format.md §2) -------------------------------------------------------------
VAULT_MAGIC = b"MOSAICV\0"  # 8 bytes, at offset 0
VERSION_MAJOR = 1  # bumped when a v1 reader would misread the file (§9)
VERSION_MINOR = 4  # bumped for additions a v1 reader may ignore (vault_format.md §9)
HEADER_SIZE = 128  # fixed header, bytes
PAGE_SIZE = 16384  # 16 KiB: every record starts on and spans whole pages
PLANE_ALIGN = 64  # every plane inside a record starts on a cache line
INDEX_ENTRY_SIZE = 32  # bytes per (layer, expert) entry

Q4_BLOCK = 32  # weights per Q4 scale, along the input dimension
Q4_BLOCK_BYTES = Q4_BLOCK // 2  # 16 bytes of nibbles per block
Q4_ZERO = 8  # code of the value 0: w = d * (q - 8)
Q3_BLOCK_BYTES = 12  # Q3_G32: 8 bytes of low bit pairs, 4 of high bits, per 32 weights
Q3_ZERO = 4  # w = d * (q - 4), q in 0..7
Q2_BLOCK_BYTES = 8  # Q2_G32: four 2-bit codes a byte
Q2_ZERO = 2  # w = d * (q - 2), q in 0..3
FP8_BLOCK = 128  # FP8 scales cover 128 x 128 blocks
FP8_E4M3_MAX = 448.0  # largest finite E4M3FN value
MXFP4_BLOCK = 32  # weights per MXFP4 power-of-two scale, along the input dimension
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2
E8M0_BIAS = 127  # an E8M0 scale byte s is 2^(s - 127); 255 is NaN
E8M0_NAN = 255
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by code

FLAG_EXPERT_BIAS = 1  # header flag: each record ends with the biases of gate, up and down (§4.4)
FLAG_PER_RECORD_QUANT = 2  # header flag: each index entry names its record's quant type and length (§5.1)
KNOWN_FLAGS = FLAG_EXPERT_BIAS | FLAG_PER_RECORD_QUANT

# bounds (§8): a reader checks these before allocating anything
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_DIM = 1 << 20  # hidden or intermediate size
MAX_RECORDS = 1 << 20  # DeepSeek-V3 has 14,848; the index stays under 32 MiB
MAX_META_BYTES = 16 << 20  # arch block and lineage block, each
MAX_RECORD_BYTES = 1 << 32


class QuantType(enum.IntEnum):
    Q4_G32 = 1  # 4-bit symmetric, one f16 scale per 32 weights of a row
    FP8_B128 = 2  # E4M3FN, one scale per 128 x 128 block
    MXFP4_G32 = 3  # OCP MXFP4: E2M1 codes, one E8M0 power-of-two scale per 32 weights of a row
    Q3_G32 = 4  # 3-bit symmetric, one f16 scale per 32 weights: a record type of a per-record Q4 vault only
    Q2_G32 = 5  # 2-bit symmetric, likewise


class ScaleDtype(enum.IntEnum):
    F16 = 1
    BF16 = 2
    F32 = 3
    E8M0 = 4  # a power of two: one exponent byte, bias 127

    @property
    def itemsize(self) -> int:
        return {ScaleDtype.F32: 4, ScaleDtype.E8M0: 1}.get(self, 2)


# The scale dtype a quant type requires, where it allows only one.
REQUIRED_SCALE_DTYPE = {QuantType.Q4_G32: ScaleDtype.F16, QuantType.MXFP4_G32: ScaleDtype.E8M0,
                        QuantType.Q3_G32: ScaleDtype.F16, QuantType.Q2_G32: ScaleDtype.F16}
QUANT_NAMES = {"q4": QuantType.Q4_G32, "fp8": QuantType.FP8_B128, "mxfp4": QuantType.MXFP4_G32}  # CLI and API spelling
# Low-bit record types: stored on disk, widened exactly to Q4_G32 when read (codes move, scales stay).
LOW_BIT_TYPES = {QuantType.Q3_G32: (3, Q3_BLOCK_BYTES, Q3_ZERO), QuantType.Q2_G32: (2, Q2_BLOCK_BYTES, Q2_ZERO)}
LOW_BIT_NAMES = {"q3": QuantType.Q3_G32, "q2": QuantType.Q2_G32}  # CLI and API spelling
HEADER_QUANTS = (QuantType.Q4_G32, QuantType.FP8_B128, QuantType.MXFP4_G32)  # a vault's compute types
RECORD_QUANTS = (QuantType.Q4_G32, QuantType.Q3_G32, QuantType.Q2_G32)  # a per-record vault's record types
VAULT_FILE = "experts.vault"  # names inside a converted model directory (§1)
BACKBONE_FILE = "backbone.safetensors"
ARCH_REQUIRED = (  # §6: keys every arch block carries
    "model_type", "num_hidden_layers", "layer_kinds", "hidden_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope", "rms_norm_eps", "num_experts", "num_experts_per_tok",
    "norm_topk_prob", "scoring_func", "moe_intermediate_size", "shared_expert_intermediate_size",
    "hidden_act", "vocab_size", "tie_word_embeddings")
PROJECTIONS = ("gate", "up", "down")  # record order (§4)

_HEADER = struct.Struct("<8sHH IIIIIIIIIII QQQQQQQQ II")  # §3 field by field
assert _HEADER.size == HEADER_SIZE
_ENTRY = struct.Struct("<IIQQII")
assert _ENTRY.size == INDEX_ENTRY_SIZE


class Reason(enum.Enum):
    """Why a vault was rejected; each is one MUST of vault_format.md §8."""

    TRUNCATED = "truncated"
    BAD_MAGIC = "bad magic"
    BAD_VERSION = "unsupported version"
    BAD_HEADER = "bad header field"
    BAD_CHECKSUM = "checksum mismatch"
    OUT_OF_BOUNDS = "out of bounds"
    MISALIGNED = "misaligned"
    OVERLAP = "overlapping records"
    BAD_INDEX = "bad index"
    BAD_METADATA = "bad metadata"
    MISSING_FILE = "missing file"


class VaultError(Exception):
    """A vault that a reader must reject. Carries the reason, the file and the place."""

    def __init__(self, reason: Reason, message: str, *, path: str | None = None,
                 offset: int | None = None, layer: int | None = None, expert: int | None = None):
        self.reason, self.path, self.offset, self.layer, self.expert = reason, path, offset, layer, expert
        where = []
        if path is not None:
            where.append(str(path))
        if layer is not None:
            where.append(f"layer {layer}")
        if expert is not None:
            where.append(f"expert {expert}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{reason.value}: {message}" + (f" ({', '.join(where)})" if where else ""))


def align_up(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def crc32(data) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def file_sha256(path) -> str:
    """A file's SHA-256 in hex, as the lineage block names source and copied files (§7)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def encode_meta(block: dict) -> bytes:
    """Arch and lineage blocks: UTF-8 JSON, keys sorted, no whitespace (§6, §7)."""
    return json.dumps(block, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode_meta(raw: bytes, what: str, *, path: str | None = None, offset: int | None = None) -> dict:
    try:
        block = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VaultError(Reason.BAD_METADATA, f"{what} block is not UTF-8 JSON: {e}", path=path, offset=offset) from None
    if not isinstance(block, dict):
        raise VaultError(Reason.BAD_METADATA, f"{what} block is not a JSON object", path=path, offset=offset)
    return block


def moe_layers_of(arch: dict, *, path: str | None = None) -> list[int]:
    """Layers whose experts live in the vault, checked against the arch block's own counts."""
    missing = [k for k in ARCH_REQUIRED if k not in arch]
    if missing:
        raise VaultError(Reason.BAD_METADATA, f"arch block lacks {', '.join(missing)}", path=path)
    kinds = arch["layer_kinds"]
    if not isinstance(kinds, list) or len(kinds) != arch["num_hidden_layers"] or \
            any(k not in ("moe", "dense") for k in kinds):
        raise VaultError(Reason.BAD_METADATA, "layer_kinds must list 'moe' or 'dense' for every layer", path=path)
    return [i for i, k in enumerate(kinds) if k == "moe"]


# --- record layout (§4) -------------------------------------------------------------------------
@dataclass(frozen=True)
class Plane:
    """One contiguous array inside a record: codes, scales or biases of one projection."""

    projection: str  # gate | up | down
    kind: str  # codes | scales | bias
    offset: int  # from the start of the record
    nbytes: int
    shape: tuple[int, ...]  # codes: [rows, bytes per row]; scales: [scale rows, scale cols]; bias: [1, rows]


@dataclass(frozen=True)
class RecordLayout:
    quant: QuantType
    scale_dtype: ScaleDtype
    hidden: int
    intermediate: int
    planes: tuple[Plane, ...]
    payload_bytes: int  # bytes up to the end of the last plane
    record_bytes: int  # payload padded to whole pages
    bias: bool = False  # FLAG_EXPERT_BIAS: float32 bias planes of gate, up and down follow the weights

    def plane(self, projection: str, kind: str) -> Plane:
        for p in self.planes:
            if p.projection == projection and p.kind == kind:
                return p
        raise KeyError((projection, kind))


def projection_shape(projection: str, hidden: int, intermediate: int) -> tuple[int, int]:
    """[rows, cols] of a projection as nn.Linear stores it: gate/up [I, H], down [H, I]."""
    return (hidden, intermediate) if projection == "down" else (intermediate, hidden)


def plane_shapes(quant: QuantType, rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(codes [rows, bytes per row], scales [scale rows, scale cols]) of one projection."""
    if quant is QuantType.Q4_G32:
        blocks = -(-cols // Q4_BLOCK)
        return (rows, blocks * Q4_BLOCK_BYTES), (rows, blocks)
    if quant is QuantType.FP8_B128:
        return (rows, cols), (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if quant is QuantType.MXFP4_G32:
        blocks = -(-cols // MXFP4_BLOCK)
        return (rows, blocks * MXFP4_BLOCK_BYTES), (rows, blocks)
    if quant in LOW_BIT_TYPES:
        blocks = -(-cols // Q4_BLOCK)
        return (rows, blocks * LOW_BIT_TYPES[quant][1]), (rows, blocks)
    raise ValueError(f"unknown quant type {quant!r}")


def record_layout(quant: QuantType, scale_dtype: ScaleDtype, hidden: int, intermediate: int,
                  bias: bool = False) -> RecordLayout:
    """Where every plane of a record sits: gate, up and down, each codes then scales; with bias, the three
    float32 bias vectors after them (so the weight planes sit where they do without)."""
    quant, scale_dtype = QuantType(quant), ScaleDtype(scale_dtype)
    required = REQUIRED_SCALE_DTYPE.get(quant)
    if required is not None and scale_dtype is not required:
        raise ValueError(f"{quant.name} scales are {required.name.lower()}")
    if required is None and scale_dtype not in (ScaleDtype.BF16, ScaleDtype.F32):
        raise ValueError(f"{quant.name} scales are bf16 or f32")
    planes, at = [], 0

    def add(proj: str, kind: str, shape: tuple[int, int], item: int) -> None:
        nonlocal at
        at = align_up(at, PLANE_ALIGN)
        nbytes = shape[0] * shape[1] * item
        planes.append(Plane(proj, kind, at, nbytes, shape))
        at += nbytes

    for proj in PROJECTIONS:
        rows, cols = projection_shape(proj, hidden, intermediate)
        codes, scales = plane_shapes(quant, rows, cols)
        add(proj, "codes", codes, 1)
        add(proj, "scales", scales, scale_dtype.itemsize)
    if bias:
        for proj in PROJECTIONS:
            add(proj, "bias", (1, projection_shape(proj, hidden, intermediate)[0]), 4)
    return RecordLayout(quant, scale_dtype, hidden, intermediate, tuple(planes), at, align_up(at, PAGE_SIZE), bias)


# --- fixed header (§3) --------------------------------------------------------------------------
@dataclass(frozen=True)
class VaultHeader:
    quant: QuantType
    scale_dtype: ScaleDtype
    num_layers: int
    num_experts: int
    hidden: int
    intermediate: int
    num_records: int
    record_bytes: int
    arch_offset: int
    arch_length: int
    lineage_offset: int
    lineage_length: int
    index_offset: int
    index_length: int
    data_offset: int
    file_size: int
    meta_crc32: int  # CRC-32 of the bytes from arch_offset to data_offset (metadata and index)
    flags: int = 0
    version_major: int = VERSION_MAJOR
    version_minor: int = VERSION_MINOR
    page_size: int = PAGE_SIZE

    def pack(self) -> bytes:
        body = _HEADER.pack(
            VAULT_MAGIC, self.version_major, self.version_minor, HEADER_SIZE, self.page_size,
            int(self.quant), int(self.scale_dtype), self.num_layers, self.num_experts, self.hidden,
            self.intermediate, self.num_records, self.record_bytes, self.flags,
            self.arch_offset, self.arch_length, self.lineage_offset, self.lineage_length,
            self.index_offset, self.index_length, self.data_offset, self.file_size,
            self.meta_crc32, 0)
        return body[:-4] + struct.pack("<I", crc32(body[:-4]))

    @classmethod
    def unpack(cls, raw: bytes, *, path: str | None = None) -> "VaultHeader":
        """Parse and check the fixed header on its own (no knowledge of the file's real size)."""
        if len(raw) < HEADER_SIZE:
            raise VaultError(Reason.TRUNCATED, f"header needs {HEADER_SIZE} bytes, file has {len(raw)}", path=path, offset=0)
        raw = bytes(raw[:HEADER_SIZE])
        f = _HEADER.unpack(raw)
        (magic, vmaj, vmin, hsize, page, quant, sdt, n_layers, n_experts, hidden, inter, n_records,
         record_bytes, flags, arch_off, arch_len, lin_off, lin_len, idx_off, idx_len, data_off,
         file_size, meta_crc, head_crc) = f
        if magic != VAULT_MAGIC:
            raise VaultError(Reason.BAD_MAGIC, f"expected {VAULT_MAGIC!r}, found {magic!r}", path=path, offset=0)
        if vmaj != VERSION_MAJOR:
            raise VaultError(Reason.BAD_VERSION, f"major version {vmaj}, this reader reads {VERSION_MAJOR}", path=path, offset=8)
        if crc32(raw[:-4]) != head_crc:
            raise VaultError(Reason.BAD_CHECKSUM, "fixed header CRC-32 does not match", path=path, offset=124)

        def bad(field: str, value, off: int, why: str):
            raise VaultError(Reason.BAD_HEADER, f"{field} = {value}: {why}", path=path, offset=off)

        if hsize != HEADER_SIZE:
            bad("header_size", hsize, 12, f"must be {HEADER_SIZE}")
        if page != PAGE_SIZE:
            bad("page_size", page, 16, f"must be {PAGE_SIZE}")
        if quant not in QuantType._value2member_map_:
            bad("quant_type", quant, 20, "unknown quant type")
        if QuantType(quant) not in HEADER_QUANTS:
            bad("quant_type", quant, 20, "a record type of a per-record vault, not a vault's type")
        if sdt not in ScaleDtype._value2member_map_:
            bad("scale_dtype", sdt, 24, "unknown scale dtype")
        required = REQUIRED_SCALE_DTYPE.get(QuantType(quant))
        if required is not None and sdt != required:
            bad("scale_dtype", sdt, 24, f"{QuantType(quant).name} scales must be {required.name.lower()}")
        if required is None and sdt not in (ScaleDtype.BF16, ScaleDtype.F32):
            bad("scale_dtype", sdt, 24, f"{QuantType(quant).name} scales must be bf16 or f32")
        if flags & ~KNOWN_FLAGS:
            bad("flags", flags, 52, f"unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
        if flags & FLAG_PER_RECORD_QUANT and (quant != QuantType.Q4_G32 or flags & FLAG_EXPERT_BIAS):
            bad("flags", flags, 52, "per-record quant types need a Q4_G32 vault without expert biases")
        if not 1 <= n_layers <= MAX_LAYERS:
            bad("num_layers", n_layers, 28, f"must be in 1..{MAX_LAYERS}")
        if not 1 <= n_experts <= MAX_EXPERTS:
            bad("num_experts", n_experts, 32, f"must be in 1..{MAX_EXPERTS}")
        if not 1 <= hidden <= MAX_DIM:
            bad("hidden_size", hidden, 36, f"must be in 1..{MAX_DIM}")
        if not 1 <= inter <= MAX_DIM:
            bad("moe_intermediate_size", inter, 40, f"must be in 1..{MAX_DIM}")
        if not 1 <= n_records <= min(n_layers * n_experts, MAX_RECORDS):
            bad("num_records", n_records, 44, f"must be in 1..min(num_layers * num_experts, {MAX_RECORDS})")
        layout = record_layout(QuantType(quant), ScaleDtype(sdt), hidden, inter, bool(flags & FLAG_EXPERT_BIAS))
        if record_bytes != layout.record_bytes:
            bad("record_bytes", record_bytes, 48, f"geometry gives {layout.record_bytes}")
        if not 0 < record_bytes < MAX_RECORD_BYTES:
            bad("record_bytes", record_bytes, 48, "too large")
        if arch_off != HEADER_SIZE:
            bad("arch_offset", arch_off, 56, f"must be {HEADER_SIZE}")
        if not 2 <= arch_len <= MAX_META_BYTES:
            bad("arch_length", arch_len, 64, f"must be in 2..{MAX_META_BYTES}")
        if lin_off != arch_off + arch_len:
            bad("lineage_offset", lin_off, 72, "must follow the arch block")
        if not 2 <= lin_len <= MAX_META_BYTES:
            bad("lineage_length", lin_len, 80, f"must be in 2..{MAX_META_BYTES}")
        if idx_off != align_up(lin_off + lin_len, 8):
            bad("index_offset", idx_off, 88, "must follow the lineage block, 8-byte aligned")
        if idx_len != n_records * INDEX_ENTRY_SIZE:
            bad("index_length", idx_len, 96, f"must be num_records * {INDEX_ENTRY_SIZE}")
        if data_off != align_up(idx_off + idx_len, PAGE_SIZE):
            bad("data_offset", data_off, 104, "must be the first page boundary after the index")
        if flags & FLAG_PER_RECORD_QUANT:
            smallest = min(record_layout(q, ScaleDtype.F16, hidden, inter).record_bytes for q in RECORD_QUANTS)
            if not data_off + n_records * smallest <= file_size <= data_off + n_records * record_bytes:
                bad("file_size", file_size, 112, "must leave room for num_records records of their sizes")
        elif file_size != data_off + n_records * record_bytes:
            bad("file_size", file_size, 112, "must be data_offset + num_records * record_bytes")
        return cls(QuantType(quant), ScaleDtype(sdt), n_layers, n_experts, hidden, inter, n_records,
                   record_bytes, arch_off, arch_len, lin_off, lin_len, idx_off, idx_len, data_off,
                   file_size, meta_crc, flags, vmaj, vmin, page)

    @property
    def layout(self) -> RecordLayout:
        """The layout records have in memory, where kernels read them (a low-bit record is widened to it)."""
        return record_layout(self.quant, self.scale_dtype, self.hidden, self.intermediate,
                             bool(self.flags & FLAG_EXPERT_BIAS))

    @property
    def per_record_quant(self) -> bool:
        return bool(self.flags & FLAG_PER_RECORD_QUANT)

    def stored_layout(self, quant: QuantType) -> RecordLayout:
        """The layout of a record stored as `quant` (the header's own type, or a per-record one)."""
        return record_layout(quant, self.scale_dtype, self.hidden, self.intermediate,
                             bool(self.flags & FLAG_EXPERT_BIAS))


def plan_header(quant: QuantType, scale_dtype: ScaleDtype, num_layers: int, num_experts: int,
                hidden: int, intermediate: int, num_records: int, arch_length: int,
                lineage_length: int, bias: bool = False,
                record_quants: list[QuantType] | None = None) -> VaultHeader:
    """Offsets of every region for the given sizes; meta_crc32 is filled in by the writer. bias: the
    records carry expert biases (FLAG_EXPERT_BIAS). record_quants: each record's own type, in record order
    (FLAG_PER_RECORD_QUANT; the vault's quant is then Q4_G32 and the types are in RECORD_QUANTS)."""
    if QuantType(quant) not in HEADER_QUANTS:
        raise ValueError(f"{QuantType(quant).name} is a record type of a per-record vault, not a vault's type")
    layout = record_layout(quant, scale_dtype, hidden, intermediate, bias)
    lin_off = HEADER_SIZE + arch_length
    idx_off = align_up(lin_off + lineage_length, 8)
    idx_len = num_records * INDEX_ENTRY_SIZE
    data_off = align_up(idx_off + idx_len, PAGE_SIZE)
    flags = FLAG_EXPERT_BIAS if bias else 0
    data_bytes = num_records * layout.record_bytes
    if record_quants is not None:
        if quant != QuantType.Q4_G32 or bias or len(record_quants) != num_records or \
                any(q not in RECORD_QUANTS for q in record_quants):
            raise ValueError("per-record quant types: a Q4_G32 vault without biases, one of "
                             f"{[q.name for q in RECORD_QUANTS]} for each of its {num_records} records")
        flags |= FLAG_PER_RECORD_QUANT
        data_bytes = sum(record_layout(q, scale_dtype, hidden, intermediate).record_bytes for q in record_quants)
    return VaultHeader(QuantType(quant), ScaleDtype(scale_dtype), num_layers, num_experts, hidden,
                       intermediate, num_records, layout.record_bytes, HEADER_SIZE, arch_length,
                       lin_off, lineage_length, idx_off, idx_len, data_off, data_off + data_bytes, 0, flags)


# --- expert index (§5) --------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexEntry:
    layer: int
    expert: int
    offset: int  # absolute file offset of the record
    length: int  # bytes: record_bytes, or its own type's record size in a per-record vault
    crc32: int  # CRC-32 of the whole record as stored, padding included
    quant: int = 0  # the record's QuantType in a per-record vault (FLAG_PER_RECORD_QUANT), else 0

    def pack(self) -> bytes:
        return _ENTRY.pack(self.layer, self.expert, self.offset, self.length, self.crc32, self.quant)

    def stored_quant(self, header: VaultHeader) -> QuantType:
        """The type the record is stored as: its own in a per-record vault, else the vault's."""
        return QuantType(self.quant) if self.quant else header.quant


def pack_index(entries) -> bytes:
    return b"".join(e.pack() for e in entries)


def unpack_index(raw: bytes, header: VaultHeader, moe_layers, *, path: str | None = None) -> list[IndexEntry]:
    """Parse the index and enforce §8: sorted, unique, complete, aligned, in bounds, no overlap.

    Args:
        raw: the index bytes (header.index_length of them).
        header: the already validated fixed header.
        moe_layers: the layers the arch block says are MoE; every one must have all its experts.
    """
    if len(raw) != header.index_length:
        raise VaultError(Reason.TRUNCATED, f"index needs {header.index_length} bytes, got {len(raw)}",
                         path=path, offset=header.index_offset)
    expected = [(layer, e) for layer in sorted(moe_layers) for e in range(header.num_experts)]
    if len(expected) != header.num_records:
        raise VaultError(Reason.BAD_INDEX, f"arch block names {len(moe_layers)} MoE layers x "
                         f"{header.num_experts} experts, header says {header.num_records} records", path=path)
    entries, prev_end = [], header.data_offset
    for i, fields in enumerate(_ENTRY.iter_unpack(raw)):
        layer, expert, offset, length, crc, reserved = fields
        at = header.index_offset + i * INDEX_ENTRY_SIZE
        if (layer, expert) != expected[i]:
            raise VaultError(Reason.BAD_INDEX, f"entry {i} is (layer {layer}, expert {expert}), "
                             f"expected {expected[i]}", path=path, offset=at, layer=layer, expert=expert)
        if header.per_record_quant:
            if reserved not in RECORD_QUANTS:
                raise VaultError(Reason.BAD_INDEX, f"entry {i} quant type is {reserved}, not one of "
                                 f"{[int(q) for q in RECORD_QUANTS]}", path=path, offset=at, layer=layer, expert=expert)
            want = header.stored_layout(QuantType(reserved)).record_bytes
        elif reserved != 0:
            raise VaultError(Reason.BAD_INDEX, f"entry {i} reserved field is {reserved}", path=path, offset=at,
                             layer=layer, expert=expert)
        else:
            want = header.record_bytes
        if length != want:
            raise VaultError(Reason.BAD_INDEX, f"length {length}, the record's type takes {want} bytes",
                             path=path, offset=at, layer=layer, expert=expert)
        if offset % PAGE_SIZE:
            raise VaultError(Reason.MISALIGNED, f"record offset {offset} is not on a {PAGE_SIZE}-byte page",
                             path=path, offset=at, layer=layer, expert=expert)
        if offset < prev_end:
            raise VaultError(Reason.OVERLAP, f"record at {offset} starts before the previous one ends ({prev_end})",
                             path=path, offset=at, layer=layer, expert=expert)
        if offset + length > header.file_size:
            raise VaultError(Reason.OUT_OF_BOUNDS, f"record [{offset}, {offset + length}) runs past the end "
                             f"of the file ({header.file_size})", path=path, offset=at, layer=layer, expert=expert)
        prev_end = offset + length
        entries.append(IndexEntry(layer, expert, offset, length, crc, reserved))
    if header.per_record_quant and prev_end != header.file_size:
        raise VaultError(Reason.BAD_INDEX, f"the records end at {prev_end}, the file at {header.file_size}",
                         path=path, offset=header.index_offset)
    return entries
