"""Expert reads: Direct I/O against buffered pread, cold (page cache dropped) and warm, against a raw
sequential O_DIRECT read of the same file in the same run.

    python benchmarks/reader_bench.py [--vault bench-data/out-q4] [--rounds 3]

Reads go through the engine's own ExpertStore and native ring: groups of 8 distinct experts of one layer at a time (a
decode step's top-8), all misses (a ring of 8 slots, every group new), in a seeded random order, with
the CRC-32 check every read gets. Run benchmarks/convert_bench.py first to make the vault. stream_all reads
the same way with the queue kept full (benchmarks/trace_replay.py's disk probe).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.convert_bench import drop_caches, raw_read  # noqa: E402
from mosaic_runtime.cache.ring import Ring, SlotState  # noqa: E402
from mosaic_runtime.cache.store import IO_THREADS, ExpertStore  # noqa: E402
from mosaic_runtime.vault import open_vault  # noqa: E402

TOP_K = 8


def read_all(vault, io: str, seed: int) -> float:
    """GB/s reading every record once, TOP_K at a time."""
    store = ExpertStore(vault, TOP_K, io)
    keys = list(vault.entries)
    random.Random(seed).shuffle(keys)
    by_layer: dict[int, list[int]] = {}
    for layer, e in keys:
        by_layer.setdefault(layer, []).append(e)
    groups = [(layer, es[i:i + TOP_K]) for layer, es in by_layer.items() for i in range(0, len(es), TOP_K)]
    random.Random(seed + 1).shuffle(groups)
    t = time.perf_counter()
    for layer, es in groups:
        slots = store.acquire(layer, es)  # all TOP_K reads start at once on the ring's I/O threads
        store.wait(slots)
        store.release(slots)
        store.policy.where.clear()  # forget: every group is a miss
        store.policy.free = list(range(TOP_K))
    dt = time.perf_counter() - t
    n = store.io.bytes_read
    store.close()
    return n / dt / 1e9


def probe_ring(vault, io: str, in_flight: int = 3 * IO_THREADS) -> Ring:
    """A ring for stream_all, its memory touched once so that no probe pays the page faults. It checks no
    CRC-32: a probe measures the disk, not the cores."""
    ring = Ring(vault.path, in_flight, vault.header.record_bytes, io, IO_THREADS, verify=False)
    for slot in range(in_flight):
        ring.view(slot)[:] = 0
    return ring


def stream_all(vault, io: str, seed: int, sample: int | None = None, ring: Ring | None = None) -> float:
    """GB/s reading every record once through the engine's ring in a seeded random order with the queue
    kept full (every slot of `ring` in flight, the next read started as soon as the oldest lands): the most
    this reader gets from the disk, with no gap between one batch's last read and the next batch's first.
    `sample`: only the first that many records of the order (a short probe). `ring`: a probe_ring to reuse
    (kept open); by default one is made and closed."""
    own = ring is None
    ring = probe_ring(vault, io) if own else ring
    in_flight = ring.n_slots
    keys = list(vault.entries)
    random.Random(seed).shuffle(keys)
    keys = keys[:sample]
    n = 0
    t = time.perf_counter()
    try:
        for i, key in enumerate(keys):
            slot = i % in_flight
            if i >= in_flight:
                _landed(ring, slot)
            entry = vault.entry(*key)
            ring.submit(slot, entry.offset, entry.length, entry.crc32)
            n += entry.length
        for slot in range(min(in_flight, len(keys))):
            _landed(ring, slot)
        return n / (time.perf_counter() - t) / 1e9
    finally:
        if own:
            ring.close()


def _landed(ring: Ring, slot: int) -> None:
    if ring.wait(slot) != SlotState.IN_USE:
        raise RuntimeError(f"slot {slot}: a read failed")
    ring.set_state(slot, SlotState.EMPTY)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vault", type=Path, default=ROOT / "bench-data" / "out-q4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    vault = open_vault(args.vault)
    print(f"vault {vault.path} ({vault.path.stat().st_size / 1e9:.2f} GB, {len(vault.entries)} records of "
          f"{vault.header.record_bytes / 2**20:.2f} MiB); cache drop {'works' if drop_caches() else 'DENIED'}")
    rows = {k: [] for k in ("raw O_DIRECT sequential 4 MiB", "direct cold", "buffered cold", "direct warm",
                            "buffered warm")}
    for r in range(args.rounds):  # interleaved, so drift hits every mode alike
        drop_caches()
        n, dt = raw_read([vault.path])
        rows["raw O_DIRECT sequential 4 MiB"].append(n / dt / 1e9)
        drop_caches()
        rows["direct cold"].append(read_all(vault, "direct", r))
        drop_caches()
        rows["buffered cold"].append(read_all(vault, "buffered", r))
        rows["buffered warm"].append(read_all(vault, "buffered", r + 100))  # the file is in the page cache now
        rows["direct warm"].append(read_all(vault, "direct", r + 200))
    raw = statistics.median(rows["raw O_DIRECT sequential 4 MiB"])
    print("| mode | GB/s (median) | runs | vs raw O_DIRECT |")
    print("|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} | "
              f"{statistics.median(v) / raw:.2f} |")


if __name__ == "__main__":
    main()
