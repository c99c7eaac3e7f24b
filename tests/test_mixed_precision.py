"""Experts at their own precision: the low-bit record types, their widening, per-record vaults, and the
calibrate -> convert --routing path, against references written from vault_format.md §4.5 and §5.1."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from builders import add_chat_tokenizer
from reference import reference_model
from test_format import ARCH, BACKBONE, HIDDEN, INTER, LINEAGE, exact_weights

from mosaic_runtime import _native
from mosaic_runtime.cache.store import ExpertStore
from mosaic_runtime.engine import Engine
from mosaic_runtime.vault import Reason, VaultError, open_vault
from mosaic_runtime.vault.format import (BACKBONE_FILE, FLAG_PER_RECORD_QUANT, HEADER_SIZE, INDEX_ENTRY_SIZE,
                                         LOW_BIT_TYPES, PAGE_SIZE, RECORD_QUANTS, VAULT_FILE, QuantType, ScaleDtype,
                                         VaultHeader, crc32, encode_meta, plan_header, record_layout)
from mosaic_runtime.vault.quant import (dequantize_low_bit, dequantize_q4, pack_low_bit, quantize_low_bit, quantize_q4,
                                        unpack_low_bit, widen_to_q4)
from mosaic_runtime.vault.record import dequantize_record, pack_record, widen_record
from mosaic_shatter.write_vault import VaultWriter

LOW = (QuantType.Q3_G32, QuantType.Q2_G32)
BIN = Path(sys.executable).parent


# --- the bit order, from the spec's words -------------------------------------------------------
def spec_bytes(codes: list[int], quant: QuantType) -> bytes:
    """One block's bytes, element by element as §4.5 words it (no shifts shared with the encoder)."""
    out = [0] * LOW_BIT_TYPES[quant][1]
    for e, q in enumerate(codes):
        out[e % 8] += (q % 4) * 4 ** (e // 8)  # low two bits: byte e mod 8, pair e div 8
        if quant is QuantType.Q3_G32:
            out[8 + e % 4] += (q // 4) * 2 ** (e // 4)  # third bit: byte 8 + e mod 4, bit e div 4
    return bytes(out)


@pytest.mark.parametrize("quant", LOW)
def test_golden_block_bytes(quant):
    bits = LOW_BIT_TYPES[quant][0]
    codes = [(7 * e + 3) % (1 << bits) for e in range(32)]
    packed = pack_low_bit(torch.tensor(codes, dtype=torch.uint8).view(1, 1, 32), quant)
    assert bytes(packed.numpy()) == spec_bytes(codes, quant)
    assert unpack_low_bit(packed, quant).flatten().tolist() == codes


def test_golden_q3_bytes_written_out():
    # codes e % 8: byte j < 8 holds elements j, j+8, j+16, j+24, whose low pairs are all j % 4 (0x00, 0x55,
    # 0xaa, 0xff); the third bit of element j + 4i is set for odd i, so bytes 8-11 are 0b10101010
    codes = [e % 8 for e in range(32)]
    packed = pack_low_bit(torch.tensor(codes, dtype=torch.uint8).view(1, 1, 32), QuantType.Q3_G32)
    assert bytes(packed.numpy()).hex() == "0055aaff0055aaff" "aaaaaaaa"
    q2 = pack_low_bit(torch.tensor([e % 4 for e in range(32)], dtype=torch.uint8).view(1, 1, 32), QuantType.Q2_G32)
    assert bytes(q2.numpy()).hex() == "0055aaff0055aaff"


@pytest.mark.parametrize("quant", LOW)
def test_widening_is_exact(quant):
    w = torch.randn(7, 70) * 0.02  # a partial last block
    codes, scales = quantize_low_bit(w, quant)
    wide = widen_to_q4(codes, quant)
    assert torch.equal(dequantize_q4(wide, scales, 70), dequantize_low_bit(codes, scales, 70, quant))
    levels = dequantize_low_bit(codes, scales, 70, quant) / scales.float().repeat_interleave(32, 1)[:, :70]
    zero = LOW_BIT_TYPES[quant][2]
    assert levels.min() >= -zero and levels.max() <= (1 << LOW_BIT_TYPES[quant][0]) - 1 - zero


@pytest.mark.parametrize("quant", LOW)
def test_encoder_beats_the_amax_scale_and_orders_by_bits(quant):
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    codes, scales = quantize_low_bit(w, quant)
    err = (dequantize_low_bit(codes, scales, 256, quant) - w).norm() / w.norm()
    bits, _, zero = LOW_BIT_TYPES[quant]
    blocks = w.view(64, 8, 32)  # the plain rule alone: the largest magnitude on the most negative code
    ext = torch.where(-blocks.amin(-1, keepdim=True) > blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True),
                      blocks.amax(-1, keepdim=True))
    d = (ext / -zero).half().float()
    plain = (blocks / d).round().clamp(-zero, (1 << bits) - 1 - zero) * d
    assert err <= (plain.view(64, 256) - w).norm() / w.norm()
    q4 = quantize_q4(w)
    assert err > (dequantize_q4(*q4, 256) - w).norm() / w.norm()
    assert err < {QuantType.Q3_G32: 0.25, QuantType.Q2_G32: 0.5}[quant]


@pytest.mark.parametrize("quant", LOW)
@pytest.mark.parametrize("hidden,inter", [(40, 24), (33, 70), (128, 96), (1, 1)])
def test_native_widening_matches_the_reference(quant, hidden, inter):
    stored = record_layout(quant, ScaleDtype.F16, hidden, inter)
    torch.manual_seed(hidden + inter)
    planes = {p: quantize_low_bit(torch.randn(*s) * 0.1, quant)
              for p, s in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))}
    record = pack_record(stored, planes)
    expected = widen_record(stored, record)
    buf = np.full(record_layout(QuantType.Q4_G32, ScaleDtype.F16, hidden, inter).record_bytes, 0xAB, np.uint8)
    buf[:len(record)] = np.frombuffer(record, np.uint8)
    _native.io.widen_record(buf, int(quant), hidden, inter)
    wide = record_layout(QuantType.Q4_G32, ScaleDtype.F16, hidden, inter)
    for plane in wide.planes:  # the gaps between planes are not part of the record's meaning
        assert bytes(buf[plane.offset:plane.offset + plane.nbytes]) == \
            bytes(expected[plane.offset:plane.offset + plane.nbytes]), plane
    for a, b in zip(dequantize_record(stored, record), dequantize_record(wide, bytes(buf))):
        assert torch.equal(a, b)


def test_native_widening_refuses_what_it_cannot_widen():
    buf = np.zeros(PAGE_SIZE, np.uint8)
    with pytest.raises(ValueError, match="only Q3_G32 and Q2_G32"):
        _native.io.widen_record(buf, int(QuantType.Q4_G32), HIDDEN, INTER)
    with pytest.raises(ValueError, match="does not hold"):
        _native.io.widen_record(buf[:100], int(QuantType.Q3_G32), HIDDEN, INTER)


# --- per-record vaults --------------------------------------------------------------------------
TYPES = [QuantType.Q4_G32, QuantType.Q3_G32, QuantType.Q2_G32]  # expert 0, 1, 2
H, I = 256, 160  # records of 5, 4 and 3 pages


def build_per_record_vault(directory: Path, types=TYPES) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    arch = encode_meta(dict(ARCH, num_experts=len(types), hidden_size=H, moe_intermediate_size=I))
    lineage = encode_meta(LINEAGE)
    header = plan_header(QuantType.Q4_G32, ScaleDtype.F16, 1, len(types), H, I, len(types), len(arch),
                         len(lineage), record_quants=types)
    writer = VaultWriter(directory / VAULT_FILE, header, [(0, e) for e in range(len(types))], record_quants=types)
    for e, q in enumerate(types):
        layout = header.stored_layout(q)
        encode = quantize_q4 if q is QuantType.Q4_G32 else (lambda w, q=q: quantize_low_bit(w, q))
        writer.write_record(e, pack_record(layout, {
            p: encode(exact_weights(*s, 3 * e + k)) for k, (p, s) in
            enumerate((("gate", (I, H)), ("up", (I, H)), ("down", (H, I))))}))
    writer.finish(arch, lineage)
    (directory / BACKBONE_FILE).write_bytes(BACKBONE)
    return directory / VAULT_FILE


def test_per_record_vault_round_trip(tmp_path):
    path = build_per_record_vault(tmp_path / "v")
    with open_vault(tmp_path / "v") as v:
        assert v.header.flags == FLAG_PER_RECORD_QUANT and v.header.quant is QuantType.Q4_G32
        assert v.record_quants == {"Q4_G32": 1, "Q3_G32": 1, "Q2_G32": 1}
        lengths = [v.entry(0, e).length for e in range(3)]
        assert lengths == [p * PAGE_SIZE for p in (5, 4, 3)]
        assert lengths == [record_layout(q, ScaleDtype.F16, H, I).record_bytes for q in TYPES]
        assert path.stat().st_size == v.header.data_offset + sum(lengths)
        for e, q in enumerate(TYPES):
            wide = v.read_compute_record(0, e)
            assert len(wide) >= v.layout.payload_bytes
            for a, b in zip(v.dequantize_expert(0, e), dequantize_record(v.layout, wide)):
                assert torch.equal(a, b)
        assert v.verify() == []


@pytest.mark.parametrize("io", ["buffered", "direct"])
def test_the_ring_widens_what_it_reads(tmp_path, io):
    build_per_record_vault(tmp_path / "v")
    with open_vault(tmp_path / "v") as v:
        store = ExpertStore(v, n_slots=3, io=io)
        try:
            slots = store.acquire(0, [0, 1, 2])
            store.wait(slots)
            for e, slot in enumerate(slots):
                want = v.read_compute_record(0, e)
                got = store.ring.view(slot)
                for plane in v.layout.planes:
                    assert bytes(got[plane.offset:plane.offset + plane.nbytes]) == \
                        bytes(want[plane.offset:plane.offset + plane.nbytes])
            store.release(slots)
            assert store.ring.native.bytes_read == sum(v.entry(0, e).length for e in range(3))
            assert store.io.bytes_read == store.ring.native.bytes_read  # what was read, not the slots' size
        finally:
            store.close()


def _rewrite(path: Path, mutate) -> None:
    """Edit the header and index with `mutate(header, entries)`, then fix every checksum."""
    raw = bytearray(path.read_bytes())
    header = VaultHeader.unpack(raw[:HEADER_SIZE])
    mutate(raw, header)
    raw[120:124] = crc32(raw[header.arch_offset:header.data_offset]).to_bytes(4, "little")
    raw[124:128] = crc32(raw[:124]).to_bytes(4, "little")
    path.write_bytes(raw)


def _entry_field(raw, header, i, at, value, size=4):
    start = header.index_offset + i * INDEX_ENTRY_SIZE + at
    raw[start:start + size] = value.to_bytes(size, "little")


@pytest.mark.parametrize("why,mutate,reason", [
    ("a record type that is not Q4, Q3 or Q2", lambda raw, h: _entry_field(raw, h, 1, 28, 3), Reason.BAD_INDEX),
    ("no type at all", lambda raw, h: _entry_field(raw, h, 0, 28, 0), Reason.BAD_INDEX),
    ("a length other than its type's", lambda raw, h: _entry_field(raw, h, 1, 16, 2 * PAGE_SIZE, 8), Reason.BAD_INDEX),
    ("the flag on an FP8 vault", lambda raw, h: raw.__setitem__(slice(20, 28), (2).to_bytes(4, "little") +
                                                                 (3).to_bytes(4, "little")), Reason.BAD_HEADER),
    ("a low-bit type as the vault's", lambda raw, h: raw.__setitem__(slice(20, 24), (4).to_bytes(4, "little")),
     Reason.BAD_HEADER),
    ("the flag cleared", lambda raw, h: raw.__setitem__(slice(52, 56), (0).to_bytes(4, "little")), Reason.BAD_HEADER),
])
def test_hostile_per_record_vaults(tmp_path, why, mutate, reason):
    path = build_per_record_vault(tmp_path / "v")
    _rewrite(path, mutate)
    with pytest.raises(VaultError) as e:
        open_vault(tmp_path / "v")
    assert e.value.reason is reason, why


def test_records_must_end_where_the_file_does(tmp_path):
    """A file_size with room past the last record (within the header's bounds) is refused by the index."""
    path = build_per_record_vault(tmp_path / "v")
    with open(path, "ab") as f:
        f.write(b"\0" * PAGE_SIZE)
    _rewrite(path, lambda raw, h: raw.__setitem__(slice(112, 120), (h.file_size + PAGE_SIZE).to_bytes(8, "little")))
    with pytest.raises(VaultError, match="the records end at"):
        open_vault(tmp_path / "v")


@given(types=st.lists(st.sampled_from(RECORD_QUANTS), min_size=1, max_size=40), hidden=st.integers(1, 4096),
       inter=st.integers(1, 4096))
def test_per_record_header_round_trip(types, hidden, inter):
    h = plan_header(QuantType.Q4_G32, ScaleDtype.F16, 1, len(types), hidden, inter, len(types), 50, 60,
                    record_quants=types)
    assert VaultHeader.unpack(h.pack()) == h and h.per_record_quant
    assert h.file_size == h.data_offset + sum(h.stored_layout(q).record_bytes for q in types)
    assert h.record_bytes == max(h.stored_layout(q).record_bytes for q in RECORD_QUANTS)


def test_plan_header_refuses_what_the_format_does():
    with pytest.raises(ValueError, match="record type"):
        plan_header(QuantType.Q3_G32, ScaleDtype.F16, 1, 1, HIDDEN, INTER, 1, 2, 2)
    with pytest.raises(ValueError, match="per-record"):
        plan_header(QuantType.FP8_B128, ScaleDtype.F32, 1, 1, HIDDEN, INTER, 1, 2, 2, record_quants=[QuantType.Q4_G32])
    with pytest.raises(ValueError, match="per-record"):
        plan_header(QuantType.Q4_G32, ScaleDtype.F16, 1, 1, HIDDEN, INTER, 1, 2, 2, record_quants=[QuantType.MXFP4_G32])


# --- calibrate, then convert with --routing -----------------------------------------------------
def _run(*args, **kw):
    return subprocess.run([*args], capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("mixed")
    source = root / "source"  # the tiny checkpoint with a tokenizer, to read calibration text with
    shutil.copytree(tiny_dirs["per-expert"], source)
    add_chat_tokenizer(source, json.loads((source / "config.json").read_text())["vocab_size"])
    q4 = root / "q4"
    assert _run(str(BIN / "mosaic-shatter"), "convert", str(source), "-o", str(q4), "--quant", "q4",
                "--quiet").returncode == 0
    text = root / "calibration.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    r = _run(str(BIN / "mosaic"), "calibrate", str(q4), str(text), "-o", str(root / "routing.json"), "--window", "64")
    assert r.returncode == 0, r.stderr
    return root, json.loads((root / "routing.json").read_text())


def test_calibrate_counts_every_selection(calibrated):
    root, doc = calibrated
    with open_vault(root / "q4") as v:
        arch, layers = v.arch, v.moe_layers
    assert doc["format"] == "mosaic-routing-counts" and sorted(map(int, doc["counts"])) == layers
    for row in doc["counts"].values():
        assert len(row) == arch["num_experts"]
        assert sum(row) == doc["tokens"] * arch["num_experts_per_tok"]


@pytest.mark.parametrize("cold,hot_mass", [("q3", 0.6), ("q2", 0.9), ("q2", 0.0)])
def test_convert_keeps_the_hot_mass_at_q4_and_matches_transformers(calibrated, tiny_dirs, cold, hot_mass):
    root, doc = calibrated
    out = root / f"mixed-{cold}-{hot_mass}"
    r = _run(str(BIN / "mosaic-shatter"), "convert", str(tiny_dirs["per-expert"]), "-o", str(out), "--quant", "q4",
             "--routing", str(root / "routing.json"), "--cold", cold, "--hot-mass", str(hot_mass), "--quiet")
    assert r.returncode == 0, r.stderr
    assert _run(str(BIN / "mosaic-shatter"), "verify", str(out), "--quiet").returncode == 0
    with Engine.open(out, max_seq=64, precision="exact") as engine:
        v = engine.vault
        assert v.lineage["quant"]["per_record"]["hot_mass"] == hot_mass
        for layer in v.moe_layers:
            row = doc["counts"][str(layer)]
            hot = [e for e in range(len(row)) if v.entry(layer, e).stored_quant(v.header) is QuantType.Q4_G32]
            kept = sum(row[e] for e in hot)
            assert kept >= hot_mass * sum(row)  # the hot set carries the mass ...
            if hot:  # ... and is the smallest that does: drop its least-routed expert and it falls short
                assert kept - min(row[e] for e in hot) < hot_mass * sum(row)
            cold_type = {"q3": QuantType.Q3_G32, "q2": QuantType.Q2_G32}[cold]
            assert all(v.entry(layer, e).stored_quant(v.header) is cold_type for e in range(len(row)) if e not in hot)
        ids = list(range(3, 60, 2))
        ref = reference_model(tiny_dirs["per-expert"], engine)
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(engine.logits(ids), expected, atol=2e-4, rtol=1e-4)


def test_convert_refuses_a_routing_file_of_another_model(calibrated, tiny_dirs, tmp_path):
    root, doc = calibrated
    bad = tmp_path / "routing.json"
    bad.write_text(json.dumps(dict(doc, counts={k: v + [0] for k, v in doc["counts"].items()})))
    out = tmp_path / "out"
    r = _run(str(BIN / "mosaic-shatter"), "convert", str(tiny_dirs["per-expert"]), "-o", str(out), "--quant", "q4",
             "--routing", str(bad), "--quiet")
    assert r.returncode == 2 and "measured on another model" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    bad.write_text("{not json")
    r = _run(str(BIN / "mosaic-shatter"), "convert", str(tiny_dirs["per-expert"]), "-o", str(out), "--quant", "q4",
             "--routing", str(bad), "--quiet")
    assert r.returncode == 2 and "not a JSON routing file" in r.stderr and not out.exists()
    r = _run(str(BIN / "mosaic-shatter"), "convert", str(tiny_dirs["per-expert"]), "-o", str(out), "--quant", "fp8",
             "--routing", str(root / "routing.json"), "--quiet")
    assert r.returncode == 2 and "--quant q4" in r.stderr and not out.exists()


def test_calibrate_refuses_bad_input_in_one_line(calibrated, tmp_path):
    root, _ = calibrated
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    r = _run(str(BIN / "mosaic"), "calibrate", str(root / "q4"), str(binary), "-o", str(tmp_path / "r.json"))
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()
    assert os.path.exists(root / "routing.json")
