"""The expert store: ring (memory and reads) + routing policy (decisions), as the executor sees it.

`acquire(layer, experts)` pins the ring slots of a layer's experts and starts reading the missing ones at
once, all of them concurrently on the ring's I/O threads, as soon as the router has named them. The
native kernel then runs each expert the moment its record has arrived (and passed its CRC-32 check);
`finish` turns a failed read into a VaultError and empties that slot, so nothing computes on it.

When the ring can hold every record, `preload` reads them all in the background (one at a time, only
while no layer's read is queued or in progress), so a model that fits in RAM soon runs with no reads at
all, as a memory-mapped engine does once its pages are in. When it cannot, `read_ahead` reads the next
layer's likely experts (the policy's guess) in the background while the current layer computes.
"""

from __future__ import annotations

import errno as errno_names
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..vault.format import LOW_BIT_TYPES, Reason, VaultError
from .policy import RoutingPolicy
from .ring import Ring, SlotState

IO_THREADS = 4  # reads in flight at once; more did not help on this machine's disk (benchmarks/RESULTS.md)
# While the ring holds every record nothing is evicted, so the policy need not learn token by token (its
# bookkeeping was about 4 % of a decode step on an 8-layer model in RAM); it learns the last so many decode
# steps at once when it has a choice to make again (the ring shrunk under memory pressure).
DEFERRED_STEPS = 64


@dataclass
class IOCounters:
    bytes_read: int = 0  # by the layers' own reads and read_ahead's
    reads: int = 0
    preload_bytes: int = 0  # by preload's background reads, counted as they are accounted (reap, first use)
    io_s: float = 0.0  # time the kernel stood waiting for records (reads overlapped with compute excluded)
    ahead_reads: int = 0  # reads started by read_ahead (their bytes are in bytes_read once accounted)
    ahead_used: int = 0  # ... of which a layer then asked for


class ExpertStore:
    def __init__(self, vault, n_slots: int, io: str, io_threads: int = IO_THREADS, notice=None):
        self.vault = vault
        self.ring = Ring(vault.path, n_slots, vault.header.record_bytes, io, io_threads, notice)
        if vault.header.per_record_quant:  # low-bit records are widened to the vault's Q4_G32 as they land
            self.ring.set_record_geometry(vault.header.hidden, vault.header.intermediate)
        layers = sorted({layer for layer, _ in vault.entries})
        self.policy = RoutingPolicy(n_slots, layers, vault.header.num_experts, int(vault.arch["num_experts_per_tok"]))
        self.io = IOCounters()
        self._pinned: set[int] = set()
        # slot -> (key, whether preload started it): reads not yet accounted by finish
        self._reading: dict[int, tuple[tuple[int, int], bool]] = {}
        self._preloading: deque[int] = deque()  # preload's slots in the order it started them (reap)
        # slot_table[layer, expert]: the slot whose record is held and checked (read, accounted, not
        # evicted), else -1. The native layer loop reads it to run a layer's experts without asking.
        self.slot_table = np.full((vault.header.num_layers, vault.header.num_experts), -1, np.int32)
        self._key_at: dict[int, tuple[int, int]] = {}  # slot -> the key placed in it
        self._preload_stopped = False  # memory ran short: no more reads ahead of need
        self._ahead: set[int] = set()  # slots read_ahead filled that no layer has asked for yet
        self._next_layer = dict(zip(layers, layers[1:]))
        # what the policy has yet to learn while the ring holds every record: (token, None) for a step's
        # start, (layers, experts) for what it ran held (_catch_up)
        self._deferred: deque[tuple] = deque(maxlen=2 * DEFERRED_STEPS)

    def _holds_every_record(self) -> bool:
        return len(self.policy.where) == len(self.vault.entries) and not self._ahead

    def _catch_up(self) -> None:
        """Let the policy learn the deferred steps, in order, before it decides or forgets anything; their
        hits were counted as they ran, so the counters stay as they are."""
        if not self._deferred:
            return
        counts = {layer: (c.hits, c.misses) for layer, c in self.policy.counters.items()}
        for first, second in self._deferred:
            if second is None:
                self.policy.begin_step(first)
            else:
                self.policy.ran_held(first, second)
        for layer, c in self.policy.counters.items():
            c.hits, c.misses = counts[layer]
        self._deferred.clear()

    def begin_step(self, token: int | None) -> None:
        """A forward step begins: a decode step's input token, or None for a prefill (the policy learns)."""
        if self._holds_every_record():
            self._deferred.append((token, None))
            return
        self._catch_up()
        self.policy.begin_step(token)

    def routed(self, layer: int, experts: list[int]) -> None:
        """A decode step's layer routed its token to these experts."""
        self._catch_up()
        self.policy.routed(layer, experts)

    def acquire(self, layer: int, experts: list[int]) -> list[int]:
        """Slots for the records of `experts` (in that order), pinned; missing ones are being read. The
        layer's held records are pinned before any miss takes a slot, so none is evicted for another."""
        self._catch_up()
        self._reap_ahead()
        self.policy.rescore()
        found = [self.policy.lookup((layer, e)) for e in experts]
        pinned_before = set(self._pinned)
        self._pinned.update(s for s in found if s is not None)
        try:
            return self._acquire(layer, experts, found)
        except BaseException:
            self.release(sorted(self._pinned - pinned_before))  # nothing this call pinned stays pinned
            raise

    def _acquire(self, layer: int, experts: list[int], found: list[int | None]) -> list[int]:
        slots = []
        for e, slot in zip(experts, found):
            key = (layer, e)
            if slot in self._ahead:  # read ahead: landed, or a read under way that is already a demand read
                self._ahead.discard(slot)
                self.io.ahead_used += 1
            if slot is None:
                slot = self._place(key)
                self._submit(slot, key)
            elif slot in self._reading:  # a preload or read-ahead read: queued, in flight or arrived, unaccounted
                state = self.ring.state(slot)
                if state == SlotState.LOADING:
                    self.ring.expedite(slot)  # needed now: ahead of the rest of the fill
                elif state == SlotState.FAILED:  # read it again, now as a layer's own read
                    self._submit(slot, key)
            else:
                self.ring.set_state(slot, SlotState.IN_USE)
            self._pinned.add(slot)
            slots.append(slot)
        return slots

    def resident(self, layer: int, experts: list[int]) -> list[int] | None:
        """The slots of `experts` when every record is held and checked (no read pending), counted as hits
        and made most recent; else None, with nothing counted or changed (acquire then takes over). They
        are not pinned: nothing is read until the caller's kernel returns, so nothing can evict them."""
        self.reap()
        self._reap_ahead()
        slots = self.slot_table[layer, experts]
        if (slots < 0).any():
            return None
        self.used(layer, experts)
        return slots.tolist()

    def used(self, layer: int, experts) -> None:
        """Account experts run from their held records without acquire (resident, the native layer loop):
        hits, and most recently used, in that order; a record read ahead for them has served."""
        self._catch_up()
        for e in experts:
            self.policy.lookup((layer, e))
        if self._ahead:
            for slot in self._ahead.intersection(self.slot_table[layer, list(experts)].tolist()):
                self._ahead.discard(slot)
                self.io.ahead_used += 1

    def ran_held(self, layers: list[int], experts: np.ndarray) -> None:
        """A native decode step routed `layers` to experts[i] (ascending ids) and ran them from their held
        records: routed() and used() for each layer, in layer order (counted now, learnt later while the
        ring holds every record)."""
        if self._holds_every_record():
            self._deferred.append((layers, experts))
            for layer in layers:
                self.policy.counters[layer].hits += experts.shape[1]
            return
        self._catch_up()
        self.policy.ran_held(layers, experts)
        if self._ahead:
            held = self.slot_table[np.asarray(layers)[:, None], experts].ravel().tolist()
            for slot in self._ahead.intersection(held):
                self._ahead.discard(slot)
                self.io.ahead_used += 1

    def _place(self, key: tuple[int, int]) -> int:
        """A slot for key (policy.place); whatever it held before is no longer held."""
        excluded = self._pinned | self._reading.keys() if not self.policy.free else set()  # only evicting needs it
        try:
            slot = self.policy.place(key, excluded)
        except RuntimeError:
            # every slot is pinned or being read: reads ahead that no layer has asked for may hold the rest
            ahead = [s for s in self._ahead if s in self._reading]
            if not ahead:
                raise
            for s in ahead:
                self.ring.wait(s)
            self._reap_ahead()
            self.policy.rescore()
            slot = self.policy.place(key, self._pinned | self._reading.keys())
        self._took(slot, key)
        return slot

    def _took(self, slot: int, key: tuple[int, int]) -> None:
        old = self._key_at.get(slot)
        if old is not None:
            self.slot_table[old] = -1
        self._ahead.discard(slot)
        self._key_at[slot] = key

    def read_ahead(self, layer: int, running: list[int], guess: Callable[[], list[int] | None] | None = None) -> int:
        """While `layer` computes on the slots `running`, start reading the records the policy expects the
        next MoE layer to ask for (only when the ring cannot hold the whole vault); how many were started.
        They are background reads: they start once the layer's own reads have landed, so they do not slow
        those, and keep the disk busy while the layer's last experts and the next layer's attention run
        (a layer that asks for one still queued moves it ahead). guess: the router lookahead's guess at the
        next layer's experts, asked for only when something may be read ahead."""
        nxt = self._next_layer.get(layer)
        if nxt is None or len(self.vault.entries) <= self.policy.usable:
            return 0
        self._catch_up()
        self._reap_ahead()
        planned = self.policy.plan_ahead(nxt, self._pinned | self._reading.keys() | set(running),
                                         None if guess is None else guess())
        for slot, key in ((s, k) for k, s in planned):
            self._took(slot, key)
            self._submit(slot, key, background=True)
            self._ahead.add(slot)
        self.io.ahead_reads += len(planned)
        return len(planned)

    def _reap_ahead(self) -> None:
        """Account read_ahead's reads that have landed, so their records count as held: a failed one is
        forgotten (the layer that needs it reads it again and reports the failure)."""
        for slot in [s for s in self._ahead if s in self._reading]:
            state = self.ring.state(slot)
            if state == SlotState.LOADING:
                continue
            if state == SlotState.FAILED:
                key, _ = self._reading.pop(slot)
                self.ring.set_state(slot, SlotState.EMPTY)
                self.policy.forget(key)
                self._key_at.pop(slot, None)
                self._ahead.discard(slot)
                continue
            self.finish([slot])
            self.ring.set_state(slot, SlotState.READY)  # a demand read lands IN_USE; nothing has pinned it

    def _submit(self, slot: int, key: tuple[int, int], background: bool = False, preload: bool = False) -> None:
        """Start reading `key` into `slot`: a demand read, or a background one (it waits for the layers'
        own reads). `preload`: preload's read (its bytes are counted apart)."""
        entry = self.vault.entry(*key)
        widen = entry.quant if entry.quant in LOW_BIT_TYPES else 0  # 0: read as stored
        self.ring.submit(slot, entry.offset, entry.length, entry.crc32, background, widen)
        self._reading[slot] = (key, preload)
        self.io.reads += 1

    def preload(self) -> int:
        """If the ring can hold every record, start background reads of all it lacks, in file order (the
        layer's own reads still come first); returns how many were started (0 when the vault does not fit).
        A preloaded record is checked like any other: a failed read is retried when a layer asks for it."""
        keys = sorted(self.vault.entries, key=lambda k: self.vault.entries[k].offset)
        if len(keys) > self.policy.usable or self._preload_stopped:
            return 0
        started = 0
        for key in keys:
            if self._preload_stopped:  # memory ran short meanwhile (the valve may run on another thread)
                break
            if key in self.policy.where:
                continue
            slot = self._place(key)  # a free slot: the ring holds them all
            self._submit(slot, key, background=True, preload=True)
            self._preloading.append(slot)
            started += 1
        return started

    def stop_preload(self) -> int:
        """Cancel preload's reads that no I/O thread has started, for good (memory is short: nothing more is
        read ahead of need); returns how many. Their slots are free again."""
        self._catch_up()
        self._preload_stopped = True
        cancelled = 0
        for slot in list(self._preloading):
            entry = self._reading.get(slot)
            if entry is not None and entry[1] and self.ring.cancel(slot):
                del self._reading[slot]
                self.policy.forget(entry[0])
                self._key_at.pop(slot, None)
                cancelled += 1
        return cancelled

    def eviction_order(self) -> list[tuple[tuple[int, int], int]]:
        """The held records no one has pinned, (key, slot), in the order the policy would give them up."""
        self._catch_up()
        self.policy.rescore()  # records placed since the last layer's turn count as evictable again
        return list(self.policy.evictable(self._pinned))

    def shrink(self, slots: int) -> int:
        """Give up to `slots` ring slots' memory back to the system: free ones first, then the records the
        policy would evict first; never a pinned slot or one being read. Returns how many were given back;
        they hold nothing until grow() takes them again."""
        victims = [(None, slot) for slot in self.policy.free]  # (a free slot is never being read)
        victims += [(key, slot) for key, slot in self.eviction_order() if slot not in self._reading]
        for key, slot in victims[:slots]:
            if key is not None:
                self.policy.forget(key)
                self.slot_table[key] = -1
                self._key_at.pop(slot, None)
                self._ahead.discard(slot)
            self.policy.disable(slot)
            self.ring.discard(slot)
        return len(victims[:slots])

    def grow(self, slots: int) -> int:
        """Take back up to `slots` of the slots shrink() gave away (filled again as layers ask); how many."""
        back = sorted(self.policy.disabled)[:slots]
        for slot in back:
            self.policy.enable(slot)
        return len(back)

    def reap(self) -> None:
        """Account preload's reads that have landed (in the order it started them, which is the order it
        reads them), so the native layer loop finds them in slot_table without a layer asking first. Cheap
        when there is nothing to do: it stops at the first read still under way."""
        while self._preloading:
            slot = self._preloading[0]
            entry = self._reading.get(slot)
            if entry is not None and entry[1]:  # still preload's: not yet taken over by a layer
                state = self.ring.state(slot)
                if state == SlotState.LOADING:
                    return
                if state == SlotState.READY:  # a failed one stays: the layer that needs it reads it again
                    self.finish([slot])
            self._preloading.popleft()

    def finish_preload(self) -> None:
        """Block until preload has read every record: what it has not started goes ahead as demand reads
        (every I/O thread), then all are waited for. Failures stay for the layers to report."""
        preloading = [slot for slot, (_, preload) in self._reading.items() if preload]
        for slot in preloading:
            self.ring.expedite(slot)
        for slot in preloading:
            # an expedited read lands IN_USE (a demand read's state); unpinned, it is READY
            if self.ring.wait(slot) == SlotState.IN_USE and slot not in self._pinned:
                self.ring.set_state(slot, SlotState.READY)
        self.reap()

    def wait(self, slots: list[int]) -> None:
        """Block until every slot's record has arrived; raise (after releasing them) if one failed."""
        t = time.perf_counter()
        for slot in slots:
            self.ring.wait(slot)
        self.io.io_s += time.perf_counter() - t
        self.finish(slots)

    def finish(self, slots: list[int], wait_s: float = 0.0) -> None:
        """Account the reads of `slots` (all arrived or failed by now); raise VaultError for a failed one."""
        self.io.io_s += wait_s
        self.ring.announce_fallback()
        error = None
        for slot in slots:
            key, preload = self._reading.pop(slot, (None, False))
            if key is None:
                continue
            if self.ring.state(slot) == SlotState.FAILED:
                self.ring.set_state(slot, SlotState.EMPTY)
                self.policy.forget(key)  # its slot must not look valid to a later lookup
                self._key_at.pop(slot, None)
                self._pinned.discard(slot)
                error = error or self._read_error(key, *self.ring.failure(slot))
                continue
            self.slot_table[key] = slot
            stored = self.vault.entry(*key).length  # what was read: a low-bit record's own size
            if preload:
                self.io.preload_bytes += stored
            else:
                self.io.bytes_read += stored
        if error is not None:
            self.release(slots)
            raise error

    def _read_error(self, key, err: int, bad_crc: bool, offset: int, done: int, length: int) -> VaultError:
        layer, expert = key
        where = dict(path=str(self.vault.path), layer=layer, expert=expert)
        if bad_crc:
            return VaultError(Reason.BAD_CHECKSUM, "expert record CRC-32 does not match", offset=offset, **where)
        if err:
            name = errno_names.errorcode.get(err, str(err))
            return VaultError(Reason.TRUNCATED, f"read of {length} bytes failed: {os.strerror(err)} ({name})",
                              offset=offset + done, **where)
        return VaultError(Reason.TRUNCATED, f"short read: {done} of {length} bytes", offset=offset + done, **where)

    def release(self, slots: list[int]) -> None:
        """Unpin slots. Reads still in flight (a layer interrupted, say by Ctrl-C) are waited for first:
        good records stay cached, failed ones are forgotten, so no slot is left LOADING or unchecked."""
        pending = [slot for slot in slots if slot in self._reading]
        if pending:
            for slot in pending:
                self.ring.wait(slot)
            try:
                self.finish(pending)
            except VaultError:
                pass  # the interrupted caller never reads these; the next reader of the expert will retry
        for slot in slots:
            self._pinned.discard(slot)
            if self.ring.state(slot) == SlotState.IN_USE:
                self.ring.set_state(slot, SlotState.READY)

    def cached(self, layer: int, expert: int):
        """The ring's copy of a record that is held and checked (uint8 view, no copy), else None. Counts
        nothing and changes no eviction order: the device tier peeks here to promote an expert just run."""
        slot = self.policy.where.get((layer, expert))
        if slot is None or slot in self._reading or self.ring.state(slot) not in (SlotState.READY, SlotState.IN_USE):
            return None
        return self.ring.view(slot)

    def close(self) -> None:
        self.ring.close()
