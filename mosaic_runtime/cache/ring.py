"""The ring: a fixed set of page-aligned slots, allocated once, each holding one whole expert record.

The ring owns memory and slot states only; which record lives where is the policy's business
(cache/policy.py) and moving bytes is the reader's (io.py).
"""

from __future__ import annotations

import enum
import mmap

import numpy as np


class SlotState(enum.IntEnum):
    EMPTY = 0
    LOADING = 1
    READY = 2
    IN_USE = 3  # pinned by a running layer: never evicted


class Ring:
    def __init__(self, n_slots: int, slot_bytes: int):
        if n_slots < 1:
            raise ValueError("a ring needs at least one slot")
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        # Anonymous mmap: page-aligned, as Direct I/O requires, and allocated once for the engine's life.
        self._memory = mmap.mmap(-1, n_slots * slot_bytes)
        self._array = np.frombuffer(self._memory, np.uint8).reshape(n_slots, slot_bytes)
        self.state = np.zeros(n_slots, np.int8)  # SlotState per slot

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes as a uint8 array (no copy)."""
        return self._array[slot]

    def buffer(self, slot: int) -> memoryview:
        return memoryview(self._memory)[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    @property
    def address(self) -> int:
        return self._array.ctypes.data

    @property
    def nbytes(self) -> int:
        return self.n_slots * self.slot_bytes
