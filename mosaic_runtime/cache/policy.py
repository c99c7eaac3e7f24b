"""Which record lives in which ring slot: least-recently-used replacement, never evicting a pinned slot,
with per-layer hit and miss counters; slots given back under memory pressure are left alone."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0


@dataclass
class LRUPolicy:
    n_slots: int
    where: "OrderedDict[tuple[int, int], int]" = field(default_factory=OrderedDict)  # key -> slot, LRU first
    free: list[int] = field(default_factory=list)
    counters: dict[int, LayerCounters] = field(default_factory=lambda: defaultdict(LayerCounters))
    disabled: set[int] = field(default_factory=set)  # given back under memory pressure: never placed in

    def __post_init__(self):
        self.free = list(range(self.n_slots - 1, -1, -1))

    def lookup(self, key: tuple[int, int]) -> int | None:
        """The slot holding key (now most recently used), or None; counts a hit or a miss."""
        slot = self.where.get(key)
        c = self.counters[key[0]]
        if slot is None:
            c.misses += 1
            return None
        c.hits += 1
        self.where.move_to_end(key)
        return slot

    def place(self, key: tuple[int, int], pinned: set[int]) -> int:
        """A slot for key: a free one, else the least recently used one not pinned."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k, s in self.where.items() if s not in pinned), None)
            if victim is None:
                raise RuntimeError(f"every one of the {self.usable} usable ring slots is in use")
            slot = self.where.pop(victim)
        self.where[key] = slot
        return slot

    @property
    def usable(self) -> int:
        """Slots the policy may place records in: all but those given back under memory pressure."""
        return self.n_slots - len(self.disabled)

    def evictable(self, pinned: set[int]) -> list[tuple[tuple[int, int], int]]:
        """(key, slot) of the records that could be evicted now, least recently used first."""
        return [(k, s) for k, s in self.where.items() if s not in pinned]

    def disable(self, slot: int) -> None:
        """Stop using slot (it must hold nothing: free, or its key forgotten first)."""
        if slot in self.free:
            self.free.remove(slot)
        self.disabled.add(slot)

    def enable(self, slot: int) -> None:
        self.disabled.discard(slot)
        self.free.append(slot)

    def forget(self, key: tuple[int, int]) -> None:
        """Drop key after a failed read, so its slot holds nothing that looks valid."""
        slot = self.where.pop(key, None)
        if slot is not None:
            self.free.append(slot)
