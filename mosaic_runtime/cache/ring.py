"""The ring: a fixed set of page-aligned slots allocated once, each holding one whole expert record, with
an atomic state per slot and background I/O threads (native/src/expert_ring.cpp).

The ring owns memory, slot states and reads; which record lives where is the policy's business
(cache/policy.py), and turning failed reads into errors is the store's (cache/store.py).
"""

from __future__ import annotations

import enum

import numpy as np

from .. import _native
from ..io import open_for_reads

_io = _native.io


class SlotState(enum.IntEnum):
    EMPTY = _io.EMPTY
    LOADING = _io.LOADING
    READY = _io.READY
    IN_USE = _io.IN_USE  # pinned by a running layer: never evicted
    FAILED = _io.FAILED  # the last read failed (see failure()); emptied by the store


class Ring:
    def __init__(self, path, n_slots: int, slot_bytes: int, io: str, io_threads: int = 4, notice=None,
                 verify: bool = True):
        """verify: check each record's CRC-32 the first time the ring reads it, and trust its later reads
        (the same offset, length and CRC-32); False never checks (a benchmark's probe of the disk)."""
        if n_slots < 1:
            raise ValueError("a ring needs at least one slot")
        direct_fd, buffered_fd = open_for_reads(path, io, notice)
        self.path, self.notice, self._noticed = str(path), notice, False
        self.native = _io.ExpertRing(direct_fd, buffered_fd, n_slots, slot_bytes, io_threads, verify)
        self.n_slots, self.slot_bytes = n_slots, slot_bytes
        self._direct = direct_fd >= 0
        self._array = self.native.view()  # [n_slots, slot_bytes] uint8, no copy

    @property
    def mode(self) -> str:
        """"direct" or "buffered": what reads use now (a refused Direct-I/O read switches to buffered)."""
        return "direct" if self._direct and not self.native.fell_back else "buffered"

    def announce_fallback(self) -> None:
        """Call `notice` once if an I/O thread has had a Direct-I/O read refused and switched to buffered."""
        if self._direct and not self._noticed and self.native.fell_back:
            self._noticed = True
            if self.notice is not None:
                self.notice(f"mosaic: {self.path}: O_DIRECT read refused; reading experts through the page cache")

    def view(self, slot: int) -> np.ndarray:
        """The slot's bytes as a uint8 array (no copy)."""
        return self._array[slot]

    def state(self, slot: int) -> SlotState:
        return SlotState(self.native.state(slot))

    def set_state(self, slot: int, state: SlotState) -> None:
        self.native.set_state(slot, int(state))

    def submit(self, slot: int, offset: int, length: int, crc32: int, background: bool = False,
               widen: int = 0) -> None:
        """Start reading a record into slot (LOADING, then IN_USE once its CRC-32 checks, or FAILED; a
        record already checked by this ring is not checked again).

        background: a fill ahead of need. It starts only while no other read is queued or in progress
        (one at a time), and leaves the slot READY.
        widen: the record's QuantType when it is stored low-bit (Q3_G32, Q2_G32): the I/O thread widens it
        to Q4_G32 in the slot once its CRC-32 checks (set_record_geometry first).
        """
        self.native.submit(slot, offset, length, crc32, background, widen)

    def set_record_geometry(self, hidden: int, intermediate: int) -> None:
        """The experts' geometry, for widening low-bit records; a slot must hold its Q4_G32 record."""
        self.native.set_record_geometry(hidden, intermediate)

    def expedite(self, slot: int) -> bool:
        """Move slot's background read, if it has not started, ahead as a demand read."""
        return self.native.expedite(slot)

    def cancel(self, slot: int) -> bool:
        """Drop slot's background read if no I/O thread has taken it (the slot is then EMPTY); whether it did."""
        return self.native.cancel(slot)

    def discard(self, slot: int) -> None:
        """Give slot's pages back to the system (no read in progress, no record in use): it is EMPTY after."""
        self.native.discard(slot)

    def wait(self, slot: int) -> SlotState:
        return SlotState(self.native.wait(slot))

    def failure(self, slot: int) -> tuple[int, bool, int, int, int]:
        """(errno, bad_crc, offset, bytes done, length) of the slot's last failed read."""
        return self.native.failure(slot)

    @property
    def busy_seconds(self) -> float:
        """Seconds during which at least one read was in progress: the device busy on the ring's behalf."""
        return self.native.busy_seconds

    @property
    def address(self) -> int:
        return self.native.address

    def pin_for_cuda(self) -> None:
        """Register the slots as pinned host memory (cudaHostRegister), so ring -> VRAM copies are DMA
        transfers that run asynchronously, with no staging copy. Undone by close()."""
        import torch
        err = torch.cuda.cudart().cudaHostRegister(self.address, self._array.nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the {self._array.nbytes:,}-byte ring failed: error {int(err)}")
        self._pinned = True

    def close(self) -> None:
        self.native.shutdown()
        if getattr(self, "_pinned", False):
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._pinned = False
