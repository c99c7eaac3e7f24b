"""Promotion policies of the device expert tier: which experts are copied into device memory (VRAM) and
which are evicted, within a byte budget. Pure bookkeeping, no device: the same code decides for a CUDA
cache and for the host-memory stand-in the tests use.

Each call to `access(layer, experts)` is one layer of one token: it reports which of those experts are
resident now (they run on the device) and which to promote or evict afterwards (the copies happen in
the background and take effect for later tokens). Counters per layer: hits, misses, promotions,
evictions. Resident bytes never exceed the budget.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

Key = tuple[int, int]  # (layer, expert)


@dataclass
class TierDecision:
    hits: list[int]  # experts of this layer resident now
    promote: list[Key] = field(default_factory=list)
    evict: list[Key] = field(default_factory=list)


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    evictions: int = 0


class TierPolicy(Protocol):
    budget_bytes: int
    record_bytes: int
    counters: dict[int, TierCounters]

    def access(self, layer: int, experts: Sequence[int]) -> TierDecision: ...

    @property
    def resident(self) -> set[Key]: ...


class _Budgeted:
    def __init__(self, budget_bytes: int, record_bytes: int):
        if record_bytes <= 0:
            raise ValueError("record_bytes must be positive")
        self.budget_bytes, self.record_bytes = budget_bytes, record_bytes
        self.capacity = max(0, budget_bytes // record_bytes)
        self.counters: dict[int, TierCounters] = defaultdict(TierCounters)

    @property
    def resident_bytes(self) -> int:
        return len(self.resident) * self.record_bytes


class HitThreshold(_Budgeted):
    """The seed's rule: an expert seen `threshold` or more times is promoted; residents are evicted least
    recently used first. Counts are kept for every expert seen (a few bytes each)."""

    def __init__(self, budget_bytes: int, record_bytes: int, threshold: int = 3):
        super().__init__(budget_bytes, record_bytes)
        self.threshold = threshold
        self.seen: dict[Key, int] = defaultdict(int)
        self._lru: OrderedDict[Key, None] = OrderedDict()  # residents, least recently used first

    @property
    def resident(self) -> set[Key]:
        return set(self._lru)

    def access(self, layer: int, experts: Sequence[int]) -> TierDecision:
        c = self.counters[layer]
        decision = TierDecision(hits=[])
        now = {(layer, e) for e in experts}  # never evicted by this call
        for e in experts:
            key = (layer, e)
            self.seen[key] += 1
            if key in self._lru:
                self._lru.move_to_end(key)
                decision.hits.append(e)
                c.hits += 1
                continue
            c.misses += 1
            if self.capacity == 0 or self.seen[key] < self.threshold:
                continue
            if len(self._lru) >= self.capacity:
                # never an expert of this same call: it runs now (a hit) or was just promoted
                victim = next((k for k in self._lru if k not in now), None)
                if victim is None:
                    continue
                del self._lru[victim]
                decision.evict.append(victim)
                self.counters[victim[0]].evictions += 1
            self._lru[key] = None
            decision.promote.append(key)
            c.promotions += 1
        return decision


class DecayedFrequency(_Budgeted):
    """Frequency with exponential decay: each expert's score decays by half every `half_life` tokens and
    gains 1 per use. A non-resident expert is promoted when its score reaches `threshold` and exceeds the
    lowest resident score (which is then evicted). A token is counted each time the first layer the
    policy saw is accessed again.

    Every score decays by the same factor, so their order never changes between uses: residents sit in a
    heap keyed by log(score) - t * log(decay), fixed at their last use, and the lowest is found in log time.
    """

    def __init__(self, budget_bytes: int, record_bytes: int, half_life: float = 64.0, threshold: float = 2.0):
        super().__init__(budget_bytes, record_bytes)
        self.log_decay = math.log(0.5) / half_life
        self.threshold = threshold
        self.score: dict[Key, tuple[float, int]] = {}  # key -> (score, token it was last updated at)
        self._resident: set[Key] = set()
        self._heap: list[tuple[float, Key]] = []  # (order key, resident); stale entries skipped lazily
        self.token = 0
        self._first_layer: int | None = None

    @property
    def resident(self) -> set[Key]:
        return set(self._resident)

    def _value(self, key: Key) -> float:
        s, t = self.score.get(key, (0.0, self.token))
        return s * math.exp(self.log_decay * (self.token - t))

    def _order(self, key: Key) -> float:
        s, t = self.score[key]
        return math.log(s) - t * self.log_decay

    def _lowest_resident(self) -> Key:
        while True:
            order, key = self._heap[0]
            if key in self._resident and order == self._order(key):
                return key
            heapq.heappop(self._heap)  # evicted, or used again since it was pushed

    def access(self, layer: int, experts: Sequence[int]) -> TierDecision:
        if self._first_layer is None:
            self._first_layer = layer
        if layer == self._first_layer:
            self.token += 1
        c = self.counters[layer]
        decision = TierDecision(hits=[])
        now = {(layer, e) for e in experts}  # never evicted by this call
        for e in experts:
            key = (layer, e)
            value = self._value(key) + 1.0
            self.score[key] = (value, self.token)
            if key in self._resident:
                heapq.heappush(self._heap, (self._order(key), key))
                if len(self._heap) > 4 * self.capacity + 64:  # drop stale entries: the heap stays O(capacity)
                    self._heap = [(self._order(k), k) for k in self._resident]
                    heapq.heapify(self._heap)
                decision.hits.append(e)
                c.hits += 1
                continue
            c.misses += 1
            if self.capacity == 0 or value < self.threshold:
                continue
            if len(self._resident) >= self.capacity:
                victim = self._lowest_resident()
                if self._value(victim) >= value or victim in now:
                    continue  # every resident is used more, or the lowest is one of this call's: keep them
                self._resident.remove(victim)
                decision.evict.append(victim)
                self.counters[victim[0]].evictions += 1
            self._resident.add(key)
            heapq.heappush(self._heap, (self._order(key), key))
            decision.promote.append(key)
            c.promotions += 1
        return decision


POLICIES = {"hit-threshold": HitThreshold, "decayed-frequency": DecayedFrequency}
