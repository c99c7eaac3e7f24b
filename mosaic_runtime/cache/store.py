"""The expert store: ring (memory) + LRU policy (decisions) + record reader (I/O), as the executor sees it.

`acquire(layer, experts)` returns the ring slots of all of a layer's experts, reading the missing ones
concurrently (all at once, as soon as the router has named them) and checking each record's CRC-32
before anything computes on it; the slots stay pinned until `release`.
"""

from __future__ import annotations

import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..io import RecordReader
from ..vault.format import Reason, VaultError
from .policy import LRUPolicy
from .ring import Ring, SlotState


@dataclass
class IOCounters:
    bytes_read: int = 0
    reads: int = 0
    io_s: float = 0.0


class ExpertStore:
    def __init__(self, vault, n_slots: int, io: str, io_threads: int = 4, notice=None):
        self.vault = vault
        self.ring = Ring(n_slots, vault.header.record_bytes)
        self.policy = LRUPolicy(n_slots)
        self.reader = RecordReader(vault.path, io, notice)
        self.pool = ThreadPoolExecutor(io_threads, thread_name_prefix="mosaic-io")
        self.io = IOCounters()
        self._pinned: set[int] = set()

    def _load(self, key: tuple[int, int], slot: int) -> None:
        entry = self.vault.entry(*key)
        buf = self.ring.buffer(slot)
        self.reader.read_into(buf, entry.offset, entry.length)
        if zlib.crc32(buf[:entry.length]) != entry.crc32:
            raise VaultError(Reason.BAD_CHECKSUM, "expert record CRC-32 does not match", path=str(self.vault.path),
                             offset=entry.offset, layer=key[0], expert=key[1])

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """Slots holding the records of `experts` (in that order), pinned."""
        slots, missing = [], []
        for e in experts:
            slot = self.policy.lookup((layer, e))
            if slot is None:
                slot = self.policy.place((layer, e), self._pinned)
                self.ring.state[slot] = SlotState.LOADING
                missing.append(((layer, e), slot))
            self._pinned.add(slot)
            slots.append(slot)
        if missing:
            t = time.perf_counter()
            futures = [(key, slot, self.pool.submit(self._load, key, slot)) for key, slot in missing]
            error = None
            for key, slot, fut in futures:
                try:
                    fut.result()
                    self.ring.state[slot] = SlotState.READY
                except Exception as e:  # a failed read never reaches a kernel: the slot is emptied
                    self.ring.state[slot] = SlotState.EMPTY
                    self.policy.forget(key)
                    error = error or e
            self.io.io_s += time.perf_counter() - t
            self.io.reads += len(missing)
            self.io.bytes_read += len(missing) * self.ring.slot_bytes
            if error is not None:
                self.release(slots)
                raise error
        for slot in slots:
            self.ring.state[slot] = SlotState.IN_USE
        return slots

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._pinned.discard(slot)
            if self.ring.state[slot] == SlotState.IN_USE:
                self.ring.state[slot] = SlotState.READY

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.reader.close()
