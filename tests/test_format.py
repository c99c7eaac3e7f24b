"""The byte layout: golden bytes, header round trips, and hostile files built byte by byte."""

import dataclasses
import errno
import hashlib
import struct
import tracemalloc

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mosaic_runtime.vault import Reason, VaultError, open_vault
from mosaic_runtime.vault.format import (BACKBONE_FILE, FLAG_EXPERT_BIAS, HEADER_QUANTS, HEADER_SIZE, INDEX_ENTRY_SIZE,
                                         PAGE_SIZE, REQUIRED_SCALE_DTYPE, VAULT_FILE, IndexEntry, QuantType,
                                         ScaleDtype, VaultHeader, crc32, encode_meta, pack_index, plan_header,
                                         record_layout)
from mosaic_runtime.vault.quant import quantize_fp8, quantize_mxfp4, quantize_q4
from mosaic_runtime.vault.record import pack_record, record_biases
from mosaic_shatter import write_vault
from mosaic_shatter.write_vault import VaultWriter

HIDDEN, INTER = 40, 24  # odd on purpose: partial Q4 blocks and partial FP8 tiles
ARCH = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "layer_kinds": ["moe"], "hidden_size": HIDDEN,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "rope": {"theta": 10000.0, "type": "default", "scaling": None, "partial_rotary_factor": 1.0},
        "rms_norm_eps": 1e-6, "num_experts": 2, "num_experts_per_tok": 1, "norm_topk_prob": True,
        "scoring_func": "softmax", "moe_intermediate_size": INTER, "shared_expert_intermediate_size": 0,
        "hidden_act": "silu", "vocab_size": 16, "tie_word_embeddings": False}
BACKBONE = struct.pack("<Q", 8) + b"{}      "  # an empty safetensors file
LINEAGE = {"converter": {"name": "golden", "version": "0"},
           "backbone": {"file": BACKBONE_FILE, "bytes": len(BACKBONE), "sha256": hashlib.sha256(BACKBONE).hexdigest()}}


def exact_weights(rows, cols, seed):
    """Weights that are exact binary fractions: the golden bytes depend on no RNG and no libm."""
    i = torch.arange(rows * cols, dtype=torch.float64)
    return (((i * 37 + seed * 11) % 29 - 14) / 16).reshape(rows, cols).float()


QUANTIZE = {QuantType.Q4_G32: quantize_q4, QuantType.FP8_B128: quantize_fp8, QuantType.MXFP4_G32: quantize_mxfp4}


def expert_record(layout, seed):
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    biases = {p: exact_weights(1, s[0], 5 * seed + k)[0] for k, (p, s) in enumerate(shapes.items())} \
        if layout.bias else None
    return pack_record(layout, {p: QUANTIZE[layout.quant](exact_weights(*s, 3 * seed + k))
                                for k, (p, s) in enumerate(shapes.items())}, biases)


def build_two_expert_vault(directory, quant=QuantType.Q4_G32, order=(0, 1), bias=False):
    directory.mkdir(parents=True, exist_ok=True)
    scale = REQUIRED_SCALE_DTYPE.get(quant, ScaleDtype.F32)
    arch, lineage = encode_meta(ARCH), encode_meta(LINEAGE)
    header = plan_header(quant, scale, 1, 2, HIDDEN, INTER, 2, len(arch), len(lineage), bias)
    writer = VaultWriter(directory / VAULT_FILE, header, [(0, 0), (0, 1)])
    for i in order:
        writer.write_record(i, expert_record(header.layout, seed=i))
    writer.finish(arch, lineage)
    (directory / BACKBONE_FILE).write_bytes(BACKBONE)
    return directory / VAULT_FILE


# --- golden bytes -------------------------------------------------------------------------------
# The fixed header, field by field as vault_format.md §3 tabulates it, and the whole file.
GOLDEN_HEADER_HEX = (
    "4d4f53414943560001000400800000000040000001000000010000000100000002000000280000001800000002000000"
    "00400000000000008000000000000000d4010000000000005402000000000000af000000000000000803000000000000"
    "4000000000000000004000000000000000c00000000000006baf3a063bb5bdda")
GOLDEN_FILE_SHA256 = "163e6c5917c420a7925daac5276a070dc7575990413da8238f42ebc93dca32a2"
# The same two experts as MXFP4_G32 (quant_type 3, scale_dtype 4 = E8M0) with expert biases (flags 1).
GOLDEN_MXFP4_HEADER_HEX = (
    "4d4f53414943560001000400800000000040000003000000040000000100000002000000280000001800000002000000"
    "00400000010000008000000000000000d4010000000000005402000000000000af000000000000000803000000000000"
    "4000000000000000004000000000000000c0000000000000e740871a79af0155")
GOLDEN_MXFP4_FILE_SHA256 = "c76b4dcbf7fe0efd6145f8bdbe27809bd46bd410a8a93bf5f63c0090d104f6f4"


def test_golden_bytes_of_a_two_expert_vault(tmp_path):
    path = build_two_expert_vault(tmp_path / "a")
    raw = path.read_bytes()
    assert len(raw) == 3 * PAGE_SIZE  # metadata page + two one-page records
    assert raw[:8] == b"MOSAICV\0"
    header = raw[:HEADER_SIZE]
    assert header.hex() == GOLDEN_HEADER_HEX
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_FILE_SHA256


def test_golden_bytes_of_an_mxfp4_vault_with_expert_biases(tmp_path):
    path = build_two_expert_vault(tmp_path / "a", QuantType.MXFP4_G32, bias=True)
    raw = path.read_bytes()
    header = VaultHeader.unpack(raw)
    assert (header.quant, header.scale_dtype, header.flags) == (QuantType.MXFP4_G32, ScaleDtype.E8M0, FLAG_EXPERT_BIAS)
    assert raw[:HEADER_SIZE].hex() == GOLDEN_MXFP4_HEADER_HEX
    assert hashlib.sha256(raw).hexdigest() == GOLDEN_MXFP4_FILE_SHA256
    with open_vault(path.parent) as v:  # the biases come back as written, after the weights
        assert torch.equal(record_biases(v.layout, v.read_record(0, 1))["down"], exact_weights(1, HIDDEN, 7)[0])


def test_record_write_order_does_not_change_the_bytes(tmp_path):
    a = build_two_expert_vault(tmp_path / "a", order=(0, 1)).read_bytes()
    b = build_two_expert_vault(tmp_path / "b", order=(1, 0)).read_bytes()
    assert a == b


def test_records_written_direct_buffered_or_after_a_refused_direct_write_give_the_same_bytes(tmp_path, monkeypatch):
    opened, direct_writes = [], []
    real_open, real_pwrite = write_vault._open_direct, write_vault.pwrite_all
    monkeypatch.setattr(write_vault, "_open_direct", lambda path, fd: opened.append(real_open(path, fd)) or opened[-1])

    def counted(fd, data, offset):
        direct_writes.append(fd == opened[-1])
        real_pwrite(fd, data, offset)
    monkeypatch.setattr(write_vault, "pwrite_all", counted)
    direct = build_two_expert_vault(tmp_path / "direct").read_bytes()
    if opened[-1] is None:
        pytest.skip("this filesystem takes no Direct I/O")
    assert direct_writes.count(True) == 2  # both records went through the direct descriptor

    def refused(fd, data, offset):  # a filesystem that opens O_DIRECT but refuses the write
        if fd == opened[-1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        real_pwrite(fd, data, offset)
    monkeypatch.setattr(write_vault, "pwrite_all", refused)
    after_refusal = build_two_expert_vault(tmp_path / "refused").read_bytes()
    monkeypatch.setattr(write_vault, "_open_direct", lambda path, fd: None)
    buffered = build_two_expert_vault(tmp_path / "buffered").read_bytes()
    assert hashlib.sha256(direct).hexdigest() == GOLDEN_FILE_SHA256
    assert direct == after_refusal == buffered


# --- round trips --------------------------------------------------------------------------------
@given(quant=st.sampled_from(HEADER_QUANTS), layers=st.integers(1, 64),
       experts=st.integers(1, 512), hidden=st.integers(1, 8192), inter=st.integers(1, 8192),
       arch_len=st.integers(2, 5000), lin_len=st.integers(2, 5000), f32=st.booleans(), bias=st.booleans())
def test_header_pack_unpack_round_trip(quant, layers, experts, hidden, inter, arch_len, lin_len, f32, bias):
    scale = REQUIRED_SCALE_DTYPE.get(quant, ScaleDtype.F32 if f32 else ScaleDtype.BF16)
    records = layers * experts
    h = plan_header(quant, scale, layers, experts, hidden, inter, records, arch_len, lin_len, bias)
    h = dataclasses.replace(h, meta_crc32=crc32(b"x" * (arch_len % 7)))
    assert VaultHeader.unpack(h.pack()) == h
    assert h.data_offset % PAGE_SIZE == 0 and h.record_bytes % PAGE_SIZE == 0
    layout = record_layout(quant, scale, hidden, inter, bias)
    assert layout == h.layout
    assert all(p.offset % 64 == 0 for p in layout.planes)
    assert layout.payload_bytes <= layout.record_bytes < layout.payload_bytes + PAGE_SIZE


def test_qwen3_30b_record_is_exactly_162_pages():
    # 3 x 768 x 2048 weights at 4.5 bits: no padding at all (FACTS.md §2 gives 153 pages for g64).
    assert record_layout(QuantType.Q4_G32, ScaleDtype.F16, 2048, 768).record_bytes == 162 * PAGE_SIZE


def test_open_reads_what_was_written(tmp_path):
    path = build_two_expert_vault(tmp_path / "v", QuantType.FP8_B128)
    with open_vault(path.parent) as v:
        assert v.arch == ARCH and v.lineage == LINEAGE and v.quant == "fp8"
        gate, up, down = v.dequantize_expert(0, 1)
        assert gate.shape == (INTER, HIDDEN) and up.shape == (INTER, HIDDEN) and down.shape == (HIDDEN, INTER)
        assert v.verify() == []


# --- hostile files ------------------------------------------------------------------------------
def rewrite(path, *, header=None, index=None, arch=None):
    """Re-emit a vault with some fields changed, keeping every checksum valid unless the test breaks one."""
    raw = bytearray(path.read_bytes())
    h = VaultHeader.unpack(raw[:HEADER_SIZE])
    if arch is not None:
        assert len(arch) == h.arch_length
        raw[h.arch_offset:h.arch_offset + len(arch)] = arch
    if index is not None:
        raw[h.index_offset:h.index_offset + h.index_length] = pack_index(index)
    h = dataclasses.replace(h, meta_crc32=crc32(bytes(raw[h.arch_offset:h.data_offset])), **(header or {}))
    raw[:HEADER_SIZE] = h.pack()
    path.write_bytes(bytes(raw))


def entries(path):
    with open_vault(path.parent) as v:
        return list(v.entries.values())


@pytest.fixture
def vault(tmp_path):
    return build_two_expert_vault(tmp_path / "v")


def reject(path, reason):
    with pytest.raises(VaultError) as e:
        open_vault(path.parent)
    assert e.value.reason is reason, str(e.value)
    assert str(path.parent) in str(e.value) or str(path) in str(e.value)
    return e.value


def test_bad_magic(vault):
    raw = bytearray(vault.read_bytes())
    raw[0:8] = b"GGUF\0\0\0\0"
    vault.write_bytes(bytes(raw))
    reject(vault, Reason.BAD_MAGIC)


def test_future_major_version(vault):
    rewrite(vault, header={"version_major": 2})
    reject(vault, Reason.BAD_VERSION)


def test_newer_minor_version_is_read(vault):
    rewrite(vault, header={"version_minor": 7})
    with open_vault(vault.parent) as v:
        assert v.header.version_minor == 7


def test_flipped_header_byte(vault):
    raw = bytearray(vault.read_bytes())
    raw[36] ^= 1  # hidden_size, without fixing the header CRC
    vault.write_bytes(bytes(raw))
    reject(vault, Reason.BAD_CHECKSUM)


@pytest.mark.parametrize("field,value", [("num_experts", 2**31), ("num_layers", 0), ("hidden", 2**24),
                                         ("record_bytes", PAGE_SIZE * 7), ("page_size", 4096),
                                         ("flags", 4), ("data_offset", PAGE_SIZE + 512), ("arch_offset", 0),
                                         ("scale_dtype", int(ScaleDtype.E8M0)),
                                         ("quant", int(QuantType.MXFP4_G32))])  # MXFP4 with f16 scales
def test_header_field_out_of_bounds(vault, field, value):
    rewrite(vault, header={field: value})
    e = reject(vault, Reason.BAD_HEADER)
    assert "offset" in str(e)


def test_huge_claims_rejected_before_any_large_allocation(tmp_path):
    # A 128-byte file that claims 2**20 records of 2 GiB each: must fail on the header alone.
    d = tmp_path / "huge"
    d.mkdir()
    h = plan_header(QuantType.Q4_G32, ScaleDtype.F16, 4096, 256, 1 << 16, 1 << 14, 1 << 20, 100, 100)
    (d / VAULT_FILE).write_bytes(h.pack())
    (d / BACKBONE_FILE).write_bytes(b"")
    tracemalloc.start()
    with pytest.raises(VaultError) as e:
        open_vault(d)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert e.value.reason is Reason.TRUNCATED
    assert peak < 1 << 20


def test_more_records_than_the_bound(vault):
    rewrite(vault, header={"num_records": (1 << 20) + 1, "num_layers": 4096, "num_experts": 65536})
    reject(vault, Reason.BAD_HEADER)


def test_truncated_by_one_page(vault):
    raw = vault.read_bytes()
    vault.write_bytes(raw[:-PAGE_SIZE])
    e = reject(vault, Reason.TRUNCATED)
    assert f"offset {len(raw) - PAGE_SIZE}" in str(e)


def test_truncated_inside_the_header(vault):
    vault.write_bytes(vault.read_bytes()[:100])
    reject(vault, Reason.TRUNCATED)


def test_trailing_garbage(vault):
    with open(vault, "ab") as f:
        f.write(b"\0" * PAGE_SIZE)
    reject(vault, Reason.BAD_HEADER)


def test_unaligned_record(vault):
    es = entries(vault)
    es[1] = dataclasses.replace(es[1], offset=es[1].offset + 512)
    e = reject_after(vault, es, Reason.MISALIGNED)
    assert "layer 0, expert 1" in str(e)


def test_overlapping_records(vault):
    es = entries(vault)
    es[1] = dataclasses.replace(es[1], offset=es[0].offset)
    reject_after(vault, es, Reason.OVERLAP)


def test_record_past_the_end(vault):
    es = entries(vault)
    es[1] = dataclasses.replace(es[1], offset=es[1].offset + PAGE_SIZE)
    reject_after(vault, es, Reason.OUT_OF_BOUNDS)


def test_index_out_of_order(vault):
    es = entries(vault)
    es[0], es[1] = dataclasses.replace(es[1], offset=es[0].offset), dataclasses.replace(es[0], offset=es[1].offset)
    reject_after(vault, es, Reason.BAD_INDEX)


def test_wrong_record_length(vault):
    es = entries(vault)
    es[0] = dataclasses.replace(es[0], length=2 * PAGE_SIZE)
    reject_after(vault, es, Reason.BAD_INDEX)


def reject_after(vault, es, reason):
    rewrite(vault, index=es)
    return reject(vault, reason)


def test_corrupted_index_without_fixing_crc(vault):
    raw = bytearray(vault.read_bytes())
    h = VaultHeader.unpack(raw[:HEADER_SIZE])
    raw[h.index_offset + 8] ^= 0x40
    vault.write_bytes(bytes(raw))
    reject(vault, Reason.BAD_CHECKSUM)


def test_arch_block_not_json(vault):
    n = len(encode_meta(ARCH))
    rewrite(vault, arch=b"\xff" * n)
    reject(vault, Reason.BAD_METADATA)


def test_arch_block_missing_a_key(vault):
    broken = encode_meta(ARCH).replace(b'"num_experts_per_tok"', b'"num_experts_per_toX"')
    rewrite(vault, arch=broken)
    e = reject(vault, Reason.BAD_METADATA)
    assert "num_experts_per_tok" in str(e)


def test_flipped_record_byte_names_layer_and_expert(vault):
    es = entries(vault)
    raw = bytearray(vault.read_bytes())
    raw[es[1].offset + 100] ^= 0x01
    vault.write_bytes(bytes(raw))
    with open_vault(vault.parent) as v:  # opening reads no record
        with pytest.raises(VaultError) as e:
            v.dequantize_expert(0, 1)
        assert e.value.reason is Reason.BAD_CHECKSUM and (e.value.layer, e.value.expert) == (0, 1)
        assert e.value.offset == es[1].offset
        problems = v.verify()
    assert [(p.layer, p.expert) for p in problems if p.reason is Reason.BAD_CHECKSUM] == [(0, 1)]


def test_missing_backbone(vault):
    (vault.parent / BACKBONE_FILE).unlink()
    reject(vault, Reason.MISSING_FILE)


def test_index_entry_is_32_bytes():
    assert len(IndexEntry(1, 2, 3, 4, 5).pack()) == INDEX_ENTRY_SIZE
