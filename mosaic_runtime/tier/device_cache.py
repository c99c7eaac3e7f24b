"""The device expert cache: whole quantised records (Q4 or FP8, as in the vault) in one block of device
memory allocated at start-up, dequantised inside each expert's matmul, never stored wider.

The device is a torch device: "cuda" on a GPU machine, or "cpu", a host-memory stand-in that runs the
same bookkeeping, copies and arithmetic in CI. Copies from the ring are asynchronous on CUDA (the ring is
registered as pinned host memory, so they are DMA transfers with no staging copy); `fence()` waits for
them before the ring may reuse a slot they read from.
"""

from __future__ import annotations

import numpy as np
import torch

from ..experts import expert_ffn
from ..recipe import ExpertActivation
from ..vault.format import RecordLayout
from ..vault.record import dequantize_record, record_biases
from .policy import Key


class DeviceExpertCache:
    def __init__(self, layout: RecordLayout, capacity: int, device: torch.device,
                 act: ExpertActivation = ExpertActivation()):
        self.layout, self.device, self.capacity, self.act = layout, torch.device(device), capacity, act
        # Only the payload is copied and kept: the page tail of a record is padding.
        self.slots = torch.empty(capacity, layout.payload_bytes, dtype=torch.uint8, device=self.device)
        self.where: dict[Key, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self._pending: list = []  # CUDA events of copies still in flight
        self.bytes_copied = 0

    @property
    def resident_bytes(self) -> int:
        return len(self.where) * self.layout.record_bytes

    def evict(self, key: Key) -> None:
        self.free.append(self.where.pop(key))

    def put(self, key: Key, record: np.ndarray) -> None:
        """Copy a record's payload (host uint8, e.g. a ring slot) into a free slot."""
        if key in self.where:
            return
        if not self.free:
            raise RuntimeError(f"device expert cache is full ({self.capacity} records): evict before promoting")
        slot = self.free.pop()
        host = torch.from_numpy(record[:self.layout.payload_bytes])
        self.slots[slot].copy_(host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._pending.append(event)
        self.where[key] = slot
        self.bytes_copied += self.layout.payload_bytes

    def fence(self) -> None:
        """Wait until every copy started by put() has landed (their host memory may be reused after)."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()

    def record(self, key: Key) -> torch.Tensor:
        return self.slots[self.where[key]]

    def run(self, record: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One expert on the device: x [n, H] float32 -> [n, H], weights dequantised from `record`."""
        gate, up, down = dequantize_record(self.layout, record)
        return expert_ffn(x, gate, up, down, self.act, record_biases(self.layout, record))
