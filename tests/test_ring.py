"""The native expert ring: reads into preallocated slots, CRC checks, and the MoE driver starting on the
experts that have arrived while others are still being read."""

import threading
import time
import zlib

import numpy as np
import pytest

from mosaic_runtime import _native
from mosaic_runtime.cache.ring import Ring, SlotState
from mosaic_runtime.experts import expert_format
from mosaic_runtime.recipe import ExpertActivation
from mosaic_runtime.vault.format import QuantType, ScaleDtype, record_layout
from test_kernels import random_record, run_moe

K = _native.kernels
LAYOUT = record_layout(QuantType.Q4_G32, ScaleDtype.F16, 256, 128)


@pytest.fixture(scope="module")
def records_file(tmp_path_factory):
    """Three records, each at a page-aligned offset, as in a vault's data section."""
    records = [random_record(LAYOUT, seed) for seed in range(3)]
    path = tmp_path_factory.mktemp("ring") / "records.bin"
    path.write_bytes(b"".join(r.tobytes() for r in records))
    return path, records


def load(ring, slot, index, records, crc=None):
    rec = records[index]
    ring.submit(slot, index * LAYOUT.record_bytes, rec.size, zlib.crc32(rec) if crc is None else crc)
    return ring.wait(slot)


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_reads_land_in_their_slots_checked(records_file, io):
    path, records = records_file
    ring = Ring(path, 3, LAYOUT.record_bytes, io)
    for slot, index in ((2, 0), (0, 1), (1, 2)):
        assert load(ring, slot, index, records) == SlotState.IN_USE
    assert all(np.array_equal(ring.view(s), records[i]) for s, i in ((2, 0), (0, 1), (1, 2)))
    assert ring.native.bytes_read == sum(r.size for r in records)
    ring.set_state(0, SlotState.READY)  # released by its layer: may be refilled
    assert load(ring, 0, 1, records, crc=zlib.crc32(records[1]) ^ 1) == SlotState.FAILED
    err, bad_crc, offset, done, length = ring.failure(0)
    assert bad_crc and offset == LAYOUT.record_bytes and done == length == records[1].size
    ring.set_state(1, SlotState.READY)
    ring.submit(1, 3 * LAYOUT.record_bytes - 4096, LAYOUT.record_bytes, 0)  # runs past the end of the file
    assert ring.wait(1) == SlotState.FAILED and ring.failure(1)[3] == 4096
    ring.close()


def test_a_record_is_checked_at_its_first_read_by_a_ring(records_file, tmp_path):
    """A model larger than its ring re-reads each record many times: a ring checks a record's CRC-32 when it
    first reads it and trusts its later reads of the same record. Another ring checks it afresh; a ring
    made not to verify (the benchmarks' probe of the disk) never does."""
    source, records = records_file
    path = tmp_path / "records.bin"
    path.write_bytes(source.read_bytes())
    ring = Ring(path, 1, LAYOUT.record_bytes, "buffered")
    assert load(ring, 0, 0, records) == SlotState.IN_USE
    ring.set_state(0, SlotState.READY)
    with open(path, "r+b") as f:  # the record changes on disk after the ring checked it
        f.seek(100)
        f.write(bytes([records[0][100] ^ 0xFF]))
    assert load(ring, 0, 0, records) == SlotState.IN_USE
    assert ring.view(0)[100] == records[0][100] ^ 0xFF  # the bytes as read, not a copy kept from before
    fresh = Ring(path, 1, LAYOUT.record_bytes, "buffered")
    assert load(fresh, 0, 0, records) == SlotState.FAILED and fresh.failure(0)[1]
    probe = Ring(path, 1, LAYOUT.record_bytes, "buffered", verify=False)
    assert load(probe, 0, 0, records) == SlotState.IN_USE
    for r in (ring, fresh, probe):
        r.close()


@pytest.mark.parametrize("io_threads", [1, 3])
def test_background_reads_land_ready_beside_demand_reads(records_file, io_threads):
    """Background reads (preload) are checked like any read and leave their slots READY (not pinned);
    a demand read queued among them lands IN_USE."""
    path, records = records_file
    ring = Ring(path, 6, LAYOUT.record_bytes, "buffered", io_threads=io_threads)
    for slot in range(5):
        index = slot % 3
        ring.submit(slot, index * LAYOUT.record_bytes, records[index].size, zlib.crc32(records[index]),
                    background=True)
    assert load(ring, 5, 1, records) == SlotState.IN_USE
    assert [ring.wait(s) for s in range(5)] == [SlotState.READY] * 5
    assert all(np.array_equal(ring.view(s), records[s % 3]) for s in range(5))
    ring.set_state(0, SlotState.READY)
    ring.submit(0, 0, records[0].size, zlib.crc32(records[0]) ^ 1, background=True)
    assert ring.wait(0) == SlotState.FAILED and ring.failure(0)[1]
    ring.close()


def test_an_expedited_background_read_is_read_once(records_file):
    """expedite queues a background read again as demand; whichever copy a thread takes first is the one
    read, the other is skipped: each record lands once, checked, in its slot."""
    path, records = records_file
    ring = Ring(path, 5, LAYOUT.record_bytes, "buffered", io_threads=1)
    for slot in range(5):
        index = slot % 3
        ring.submit(slot, index * LAYOUT.record_bytes, records[index].size, zlib.crc32(records[index]),
                    background=True)
    expedited = [ring.expedite(slot) for slot in range(5)]
    assert not any(ring.expedite(slot) for slot in range(5))  # queued as demand once, never twice
    states = [ring.wait(s) for s in range(5)]
    for slot, (fast, state) in enumerate(zip(expedited, states)):
        assert state == (SlotState.IN_USE if fast else SlotState.READY)  # demand reads land IN_USE
        assert np.array_equal(ring.view(slot), records[slot % 3])
    assert ring.native.bytes_read == sum(records[s % 3].size for s in range(5))  # no record read twice
    assert not any(ring.expedite(slot) for slot in range(5))  # all read: nothing left to move
    ring.close()


def test_a_busy_slot_refuses_a_second_read(records_file):
    path, records = records_file
    ring = Ring(path, 1, LAYOUT.record_bytes, "buffered")
    load(ring, 0, 0, records)  # IN_USE: pinned by a layer
    with pytest.raises(ValueError, match="busy"):
        ring.submit(0, 0, LAYOUT.record_bytes, 0)
    ring.close()


def test_native_crc32_is_zlibs():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 79, 127, 128, 4097, 100_003):  # table tail and PCLMUL bulk
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert _native.io.crc32(data) == zlib.crc32(data.tobytes())
        assert _native.io.crc32(data[n // 2:], _native.io.crc32(data[:n // 2])) == zlib.crc32(data.tobytes())


def moe_on_ring(ring, slots, tokens, weights, x, y, threads=2):
    total, max_n = sum(len(t) for t in tokens), max(len(t) for t in tokens)
    fmt = expert_format(LAYOUT, ExpertActivation())
    scratch = np.zeros(K.scratch_floats(fmt, total, max_n, threads), np.float32)
    out = {}

    def call():
        out["result"] = K.moe_experts_ring(K.best_isa(), threads, fmt, ring.native,
                                           np.asarray(slots, np.int32), np.array([len(t) for t in tokens], np.int32),
                                           np.concatenate(tokens).astype(np.int32),
                                           np.concatenate(weights).astype(np.float32), x, y, scratch)
    worker = threading.Thread(target=call)
    worker.start()
    return worker, scratch, out


def routed(shape: str, seed=1):
    """A prefill-shaped call (an expert with two rows: whole experts a thread) or a decode-shaped one (one
    token, one row an expert: the staged driver, whose threads share an expert's projections)."""
    rng = np.random.default_rng(seed)
    if shape == "decode":
        x = rng.standard_normal((1, LAYOUT.hidden), dtype=np.float32)
        return x, [np.array([0], np.int32)] * 3, [np.array([w], np.float32) for w in (0.5, 0.75, 0.25)]
    x = rng.standard_normal((2, LAYOUT.hidden), dtype=np.float32)
    tokens = [np.array([0, 1], np.int32), np.array([1], np.int32), np.array([0], np.int32)]
    weights = [np.array([0.5, 0.25], np.float32), np.array([0.75], np.float32), np.array([0.5], np.float32)]
    return x, tokens, weights


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_kernel_runs_arrived_experts_while_a_read_is_in_flight(records_file, shape):
    path, records = records_file
    ring = Ring(path, 3, LAYOUT.record_bytes, "buffered", io_threads=1)
    load(ring, 0, 0, records)
    load(ring, 1, 1, records)
    ring.set_state(2, SlotState.LOADING)  # a read that has not landed yet
    x, tokens, weights = routed(shape)
    y = np.zeros_like(x)
    worker, scratch, out = moe_on_ring(ring, [0, 1, 2], tokens, weights, x, y)
    deadline = time.monotonic() + 10
    # The outputs of experts 0 and 1 (their scratch rows) appear while expert 2's record is still missing.
    rows = 3 if shape == "prefill" else 2
    while not (scratch[:rows * LAYOUT.hidden] != 0).reshape(rows, -1).any(1).all() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.is_alive() and not y.any() and not scratch[rows * LAYOUT.hidden:(rows + 1) * LAYOUT.hidden].any()
    ring.set_state(2, SlotState.EMPTY)
    load(ring, 2, 2, records)  # the read lands: the kernel wakes and finishes
    worker.join(10)
    failed, wait_s, total_s = out["result"]
    assert failed == -1 and wait_s > 0 and total_s >= wait_s
    want = run_moe(LAYOUT, records, tokens, weights, x, K.best_isa(), 2)
    assert np.array_equal(y, want)  # fixed combine order: arrival order changes no bit
    ring.close()


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_failed_read_voids_the_layer(records_file, shape):
    path, records = records_file
    ring = Ring(path, 3, LAYOUT.record_bytes, "buffered")
    load(ring, 0, 0, records)
    load(ring, 1, 1, records)
    x, tokens, weights = routed(shape)
    y = np.zeros_like(x)
    ring.submit(2, 2 * LAYOUT.record_bytes, records[2].size, zlib.crc32(records[2]) ^ 1)
    worker, _, out = moe_on_ring(ring, [0, 1, 2], tokens, weights, x, y)
    worker.join(10)
    assert out["result"][0] == 2 and not y.any()  # no partial sum reaches y
    ring.close()
