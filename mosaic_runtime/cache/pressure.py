"""Living within memory that shrinks after open: when what the process may still take (limits.memory_limit:
MemAvailable, its cgroup, its rlimits) falls below a margin, preload stops and the ring gives slots back
to the system, those the policy would evict first; when memory comes back, past twice the margin, the ring takes
slots again. Without this, another program starting (or a container's limit lowered) gets the engine,
the largest anonymous mapping around, OOM-killed. Only speed changes: the tokens are the same.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..limits import MemoryLimit, memory_limit
from .store import ExpertStore

CHECK_EVERY_S = 0.25  # a probe reads /proc/meminfo and the cgroup files: about 0.1 ms


@dataclass
class PressureCounters:
    given_back: int = 0  # slots given back since open
    taken_back: int = 0  # slots taken again since open
    lowest_usable: int = 0  # the fewest slots the ring has had usable


class MemoryValve:
    def __init__(self, store: ExpertStore, margin: int, floor_slots: int,
                 probe: Callable[[], MemoryLimit] = memory_limit, clock: Callable[[], float] = time.monotonic):
        self.store, self.margin, self.floor = store, margin, floor_slots
        self.probe, self.clock = probe, clock
        self._last = float("-inf")
        self._lock = threading.Lock()  # the engine's memory watch and a caller may check at once
        self.counters = PressureCounters(lowest_usable=store.policy.usable)

    def check(self, force: bool = False) -> int:
        """Probe (at most every CHECK_EVERY_S unless forced) and act; the change in usable slots."""
        with self._lock:
            return self._check(force)

    def _check(self, force: bool) -> int:
        now = self.clock()
        if not force and now - self._last < CHECK_EVERY_S:
            return 0
        self._last = now
        free, record, policy = self.probe().available, self.store.ring.slot_bytes, self.store.policy
        if free < self.margin:
            self.store.stop_preload()
            want = -(-(self.margin - free) // record)
            given = self.store.shrink(max(0, min(want, policy.usable - self.floor)))
            self.counters.given_back += given
            self.counters.lowest_usable = min(self.counters.lowest_usable, policy.usable)
            return -given
        if policy.disabled and free > 2 * self.margin:
            taken = self.store.grow((free - 2 * self.margin) // record)
            self.counters.taken_back += taken
            return taken
        return 0
