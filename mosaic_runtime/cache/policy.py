"""Which record lives in which ring slot, and which records to read before a layer asks for them.

Both policies keep the same slot bookkeeping (RingPolicy): records never evicted while pinned or being
read, per-layer hit and miss counters, slots given back under memory pressure left alone. They differ in
whom they evict:

- LRUPolicy: the least recently used record. Simple, and the reference the benchmarks compare against; it
  collapses to no hits at all once the ring is smaller than one token's working set (layers x top-k),
  since a fixed layer order then evicts each record just before the next token needs it.
- RoutingPolicy (the engine's): the record least likely to be used at its layer's next turn, from
  statistics it learns online from the routing it sees, nothing else:
    * per layer, how often the next token routes again to an expert its last turn used (the reuse
      rate), and a decayed frequency per (layer, expert) (half-life HALF_LIFE steps) that shares out
      the rest: the estimate for a layer the current token has already passed;
    * per token id, how often each expert ran for that token (a bounded table): the input token of a
      decode step is known before its first layer, and routing depends on it strongly;
    * expert co-occurrence between consecutive layers of one token: once layer l has routed, which
      experts layer l+1 is likely to pick;
    * where the engine reads ahead with the router lookahead (models/lookahead.py), its guess at layer
      l+1's experts, best first: the guess's i-th expert is expected with the share of the layer's past
      guesses whose i-th its routing then named (the guess precision of that rank).
  The same estimate says which records of the next layer to read ahead (`plan_ahead`, in a decode step
  once a layer has routed): one whose predicted use beats the record it would displace by AHEAD_MARGIN.
  On the DeepSeek-V2-Lite traces (benchmarks/RESULTS.md) this lifts the hit rate at a quarter of the
  experts from LRU's 0.44 to 0.62 (Belady, for demand reads: 0.71) while reading 3% more records.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import numpy as np

Key = tuple[int, int]  # (layer, expert)


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0


@dataclass
class RingPolicy:
    """Slot bookkeeping; subclasses say which record to evict (_touch, _eviction_order)."""

    n_slots: int
    where: dict[Key, int] = field(default_factory=dict)  # key -> slot
    free: list[int] = field(default_factory=list)
    counters: dict[int, LayerCounters] = field(default_factory=lambda: defaultdict(LayerCounters))
    disabled: set[int] = field(default_factory=set)  # given back under memory pressure: never placed in

    def __post_init__(self):
        self.free = list(range(self.n_slots - 1, -1, -1))

    def lookup(self, key: Key) -> int | None:
        """The slot holding key (now just used), or None; counts a hit or a miss."""
        slot = self.where.get(key)
        c = self.counters[key[0]]
        if slot is None:
            c.misses += 1
            return None
        c.hits += 1
        self._touch(key)
        return slot

    def place(self, key: Key, excluded: set[int]) -> int:
        """A slot for key: a free one, else the first record in eviction order whose slot is not excluded
        (pinned, or being read)."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next(iter(self.evictable(excluded, 1)), None)
            if victim is None:
                raise RuntimeError(f"every one of the {self.usable} usable ring slots is in use")
            slot = self.where.pop(victim[0])
            self._evicted(victim[0], slot)
        self.where[key] = slot
        self._touch(key)
        return slot

    @property
    def usable(self) -> int:
        """Slots the policy may place records in: all but those given back under memory pressure."""
        return self.n_slots - len(self.disabled)

    def evictable(self, excluded: set[int], limit: int | None = None) -> list[tuple[Key, int]]:
        """(key, slot) of the records that could be evicted now (their slot not excluded), first to go
        first; at most `limit` of them."""
        raise NotImplementedError

    def disable(self, slot: int) -> None:
        """Stop using slot (it must hold nothing: free, or its key forgotten first)."""
        if slot in self.free:
            self.free.remove(slot)
        self.disabled.add(slot)

    def enable(self, slot: int) -> None:
        self.disabled.discard(slot)
        self.free.append(slot)

    def forget(self, key: Key) -> None:
        """Drop key (a failed read, an evicted record), so its slot holds nothing that looks valid."""
        slot = self.where.pop(key, None)
        if slot is not None:
            self._evicted(key, slot)
            self.free.append(slot)

    # What the engine tells every policy; the routing policy learns from it.
    def begin_step(self, token: int | None) -> None:
        """A forward step begins: a decode step's input token, or None for a prefill."""

    def routed(self, layer: int, experts: list[int]) -> None:
        """A decode step's `layer` routed its token to `experts` (before it looks them up)."""

    def ran_held(self, layers: list[int], experts: np.ndarray) -> None:
        """A decode step routed its token at each of `layers` to experts[i] (ascending ids) and ran them from
        their held records: routed(), then a hit for each, layer by layer."""
        for layer, row in zip(layers, experts.tolist()):
            self.routed(layer, row)
            for e in row:
                self.lookup((layer, e))

    def plan_ahead(self, layer: int, excluded: set[int], guess: list[int] | None = None) -> list[tuple[Key, int]]:
        """Records of `layer` worth reading before it asks, each given a slot (whatever it held is evicted):
        [(key, slot)]; none by default. guess: the experts a router lookahead expects `layer` to route to
        (models/lookahead.py), when the caller has one."""
        return []

    def rescore(self) -> None:
        """A layer is about to look its experts up: what earlier layers used counts from now on."""

    def _touch(self, key: Key) -> None:
        pass

    def _evicted(self, key: Key, slot: int) -> None:
        pass


@dataclass
class LRUPolicy(RingPolicy):
    where: "OrderedDict[Key, int]" = field(default_factory=OrderedDict)  # least recently used first

    def _touch(self, key: Key) -> None:
        self.where.move_to_end(key)

    def evictable(self, excluded: set[int], limit: int | None = None) -> list[tuple[Key, int]]:
        out = []
        for k, s in self.where.items():
            if s not in excluded:
                out.append((k, s))
                if limit is not None and len(out) >= limit:
                    break
        return out


HALF_LIFE = 8.0  # steps over which an expert's recent use counts half
TOKEN_PRIOR = 2.0  # pseudo-observations of the recent-use estimate blended into a token's own counts
AHEAD_MARGIN = 0.6  # read ahead only what is this much likelier to run than what it would displace
REUSE_WINDOW = 256  # decode turns over which a layer's reuse rate (and its guess precision) is averaged
GUESS_PRIOR = 0.5  # the precision of a rank of a layer's guesses before any guess of it has been checked
TOKEN_TABLE_BYTES = 16 << 20  # bound on the per-token routing counts (uint8, layers x experts each)


class RoutingPolicy(RingPolicy):
    """Evicts the record least likely to run at its layer's next turn; reads ahead what is likely to."""

    def __init__(self, n_slots: int, layers: list[int], num_experts: int, top_k: int):
        super().__init__(n_slots)
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        n = max(self.layers) + 1
        self._row = np.full(n, -1, np.int64)  # vault layer -> row of the arrays below
        self._row[self.layers] = np.arange(len(self.layers))
        L, E = len(self.layers), num_experts
        self._next = {a: b for a, b in zip(self.layers, self.layers[1:])}
        self._decay = math.log(2) / HALF_LIFE
        self._value = np.zeros((L, E))  # decayed use count, as of _stamp
        self._stamp = np.zeros((L, E))
        self._co = np.full((max(L - 1, 1), E, E), 0.1, np.float32)  # [l, e at l, e' at l+1]: co-occurrence
        self._seen = np.ones((L, E), np.float32)  # how often each expert ran: the marginal of _co's columns
        self._last = np.zeros((L, E), bool)  # the experts each layer routed to at its last decode turn
        self._reuse = np.full(L, top_k / E)  # per layer: share of its top-k the next token routes to again
        self._turns = np.zeros(L)  # decode turns each layer has had (the reuse average's weight, capped)
        # per layer and rank: how often a guess's i-th expert (best first) was one its routing then named
        self._precision = np.full((L, top_k), GUESS_PRIOR)
        self._checked = np.zeros(L)  # guesses checked per layer (the precision average's weight, capped)
        self._guessed: dict[int, np.ndarray] = {}  # row -> this step's guess for it (best first), until it routes
        self._tokens: OrderedDict[int, list] = OrderedDict()  # token id -> [counts uint8 [L, E], n]
        self._token_cap = max(16, TOKEN_TABLE_BYTES // (L * E))
        self._clock = 0
        self._token: int | None = None  # the decode step's input token, or None in a prefill
        self._step_routes = np.full((L, top_k), -1, np.int64)  # this decode step's routing so far
        self._layer_row = -1  # the row of the layer this decode step routed last
        self._predicted: np.ndarray | None = None  # [L, E]: expected uses by this token
        self._recent_now: np.ndarray | None = None  # _recent() of this step; rows refreshed as they are used
        self._stale_rows: set[int] = set()
        self._slot_score: np.ndarray | None = None  # per slot, valid until rescore()
        self._slot_row = np.full(n_slots, -1, np.int64)  # slot -> (row, expert) it holds, or -1
        self._slot_expert = np.zeros(n_slots, np.int64)

    # --- what the engine says ---------------------------------------------------------------------
    def begin_step(self, token: int | None) -> None:
        self._learn_step()
        self._clock += 1
        self._token = token
        self._layer_row = -1
        self._predicted = None
        self._recent_now = None
        self._guessed.clear()  # a guess its layer never checked (a step cut short) is not scored
        self.rescore()

    def routed(self, layer: int, experts: list[int]) -> None:
        r = int(self._row[layer])
        k = min(len(experts), self.top_k)
        self._step_routes[r, :k] = experts[:k]
        self._layer_row = r
        if self._turns[r] > 0:
            n = min(self._turns[r], REUSE_WINDOW)
            self._reuse[r] += (self._last[r, experts[:k]].sum() / k - self._reuse[r]) / (n + 1)
        self._turns[r] += 1
        self._last[r] = False
        self._last[r, experts[:k]] = True
        self._check_guess(r, experts)
        self._stale_rows.add(r)
        self.rescore()

    def _check_guess(self, r: int, experts) -> None:
        """Fold which of this step's guesses for row r its routing named into the row's guess precision."""
        guess = self._guessed.pop(r, None)
        if guess is not None:
            n = min(self._checked[r], REUSE_WINDOW)
            p = self._precision[r, :len(guess)]
            p += (np.isin(guess, experts) - p) / (n + 1)
            self._checked[r] += 1

    def ran_held(self, layers: list[int], experts: np.ndarray) -> None:
        # routed() and _touch() for every layer at once: a decode step's bookkeeping in a few array ops
        # instead of a Python call per expert (about half a millisecond a token on an 8-layer model).
        if any((layer, e) not in self.where for layer, row in zip(layers, experts.tolist()) for e in row):
            return super().ran_held(layers, experts)  # not all held: lookups count the misses
        rows = self._row[layers]
        k = min(experts.shape[1], self.top_k)
        top = experts[:, :k]
        self._step_routes[rows, :k] = top
        self._layer_row = int(rows[-1])
        again = self._turns[rows] > 0
        if again.any():
            r = rows[again]
            n = np.minimum(self._turns[r], REUSE_WINDOW)
            self._reuse[r] += (self._last[r[:, None], top[again]].sum(axis=1) / k - self._reuse[r]) / (n + 1)
        self._turns[rows] += 1
        self._last[rows] = False
        self._last[rows[:, None], top] = True
        for r, row in zip(rows.tolist(), top):
            self._check_guess(r, row)
        for layer in layers:
            self.counters[layer].hits += experts.shape[1]
        at = rows[:, None], experts
        self._value[at] = self._value[at] * np.exp(-self._decay * (self._clock - self._stamp[at])) + 1.0
        self._stamp[at] = self._clock
        self._stale_rows.update(rows.tolist())
        self.rescore()

    def rescore(self) -> None:
        self._slot_score = None

    # --- estimates ---------------------------------------------------------------------------------
    def _recent(self) -> np.ndarray:
        """Expected uses of each expert at its layer's next turn, from decayed use counts: [L, E]."""
        if self._recent_now is None:
            self._recent_now = self._recent_rows(slice(None))
            self._stale_rows.clear()
        for r in self._stale_rows:
            self._recent_now[r] = self._recent_rows(r)
        self._stale_rows.clear()
        return self._recent_now

    def _recent_rows(self, rows) -> np.ndarray:
        v = self._value[rows] * np.exp(-self._decay * (self._clock - self._stamp[rows]))
        # an expert the layer's last turn used comes back with the layer's reuse rate; the rest share what is
        # left of the top-k in proportion to their recent use
        last, reuse = self._last[rows], self._reuse[rows][..., None]
        rest = np.where(last, 0.0, v + 1e-6)
        rest = rest / rest.sum(-1, keepdims=True) * (self.top_k - last.sum(-1, keepdims=True) * reuse)
        return np.where(last, reuse, rest)

    def _expected(self) -> np.ndarray:
        """Expected uses of each expert by this decode step's token: its own routing counts blended with
        the recent-use estimate, [L, E]."""
        if self._predicted is None:
            recent = self._recent()
            entry = self._tokens.get(self._token) if self._token is not None else None
            if entry is None:
                self._predicted = recent.copy()  # plan_ahead refines this step's rows in place
            else:
                counts, n = entry
                self._predicted = (counts + TOKEN_PRIOR * recent) / (n + TOKEN_PRIOR)
        return self._predicted

    def _eviction_scores(self) -> np.ndarray:
        """Probability-like value of keeping each record: layers this token has yet to reach are scored by
        what this token is expected to use, the rest by recent use (their next turn is the next token's)."""
        recent = self._recent()
        if self._token is None and self._layer_row < 0:
            return recent
        ahead = np.arange(len(self.layers))[:, None] > self._layer_row
        return np.where(ahead, self._expected(), recent)

    def _next_layer_estimate(self, r: int) -> np.ndarray:
        """Expected uses at row r + 1 given the experts row r routed to this step: [E]."""
        base = self._expected()[r + 1]
        chosen = self._step_routes[r]
        chosen = chosen[chosen >= 0]
        if len(chosen) == 0:
            return base
        rows = self._co[r][chosen]
        given = (rows / rows.sum(1, keepdims=True)).mean(0)  # P(e' | what row r chose)
        marginal = self._seen[r + 1] / self._seen[r + 1].sum()
        q = base * given / marginal
        return q / (q.sum() + 1e-12) * self.top_k

    # --- eviction ---------------------------------------------------------------------------------
    def evictable(self, excluded: set[int], limit: int | None = None) -> list[tuple[Key, int]]:
        score = self._slot_scores(excluded)
        if limit == 1:
            order = np.array([np.argmin(score)])
        else:
            order = np.argsort(score, kind="stable")[:limit]
        return [(self._key_in(s), s) for s in order.tolist() if np.isfinite(score[s])]

    def _key_in(self, slot: int) -> Key:
        return self.layers[self._slot_row[slot]], int(self._slot_expert[slot])

    def _slot_scores(self, excluded) -> np.ndarray:
        """Each slot's eviction score (inf: holds nothing, or excluded), computed once per layer's turn (a
        record placed since is not evicted again before the next: its layer holds it)."""
        if self._slot_score is None:
            held = self._slot_row >= 0
            self._slot_score = np.full(self.n_slots, np.inf)
            self._slot_score[held] = self._eviction_scores()[self._slot_row[held], self._slot_expert[held]]
        if not excluded:
            return self._slot_score
        score = self._slot_score.copy()
        score[np.fromiter(excluded, np.int64, len(excluded))] = np.inf
        return score

    def _with_guess(self, row: int, q: np.ndarray, guess: list[int]) -> np.ndarray:
        """q (expected uses at `row`) with a router lookahead's guess (best first) folded in: its i-th expert
        runs with the row's guess precision of rank i (or q's estimate, if higher); the others share what
        is left of the top-k in proportion to q."""
        guess = np.asarray(list(dict.fromkeys(guess))[:self.top_k], np.int64)  # repeats dropped, order kept
        self._guessed[row] = guess
        p = np.zeros(self.num_experts)
        p[guess] = self._precision[row, :len(guess)]
        named = np.zeros(self.num_experts, bool)
        named[guess] = True
        rest = np.where(named, 0.0, q)
        rest = rest / (rest.sum() + 1e-12) * max(self.top_k - p.sum(), 0.0)
        return np.where(named, np.maximum(p, q), rest)

    def plan_ahead(self, layer: int, excluded: set[int], guess: list[int] | None = None) -> list[tuple[Key, int]]:
        r = int(self._row[layer]) - 1  # read ahead `layer` from what the layer before it routed
        if r < 0 or r != self._layer_row:  # layer r has not routed this step (a prefill does not say)
            return []
        q = self._next_layer_estimate(r)
        if guess is not None:
            q = self._with_guess(r + 1, q, guess)
        self._expected()[r + 1] = q  # this token's estimate for the layer, refined
        self.rescore()
        planned = []
        for e in np.argsort(-q)[:self.top_k].tolist():
            key = (layer, e)
            if key in self.where:
                continue
            if self.free:
                slot = self.free.pop()
            else:
                score = self._slot_scores(excluded)
                slot = int(np.argmin(score))
                if not score[slot] + AHEAD_MARGIN < q[e]:
                    break  # the rest are likelier still to be wrong
                victim = self._key_in(slot)
                del self.where[victim]
                self._evicted(victim, slot)
            self.where[key] = slot
            self._hold(key, slot)
            planned.append((key, slot))
        return planned

    def place(self, key: Key, excluded: set[int]) -> int:
        slot = super().place(key, excluded)
        self._hold(key, slot)
        return slot

    def _hold(self, key: Key, slot: int) -> None:
        """slot now holds key: it is not evicted again until routing moves on (the caller pins it)."""
        self._slot_row[slot] = self._row[key[0]]
        self._slot_expert[slot] = key[1]
        if self._slot_score is not None:
            self._slot_score[slot] = np.inf

    def _evicted(self, key: Key, slot: int) -> None:
        self._slot_row[slot] = -1
        if self._slot_score is not None:
            self._slot_score[slot] = np.inf

    def _touch(self, key: Key) -> None:
        r, e = int(self._row[key[0]]), key[1]
        self._value[r, e] = self._value[r, e] * math.exp(-self._decay * (self._clock - self._stamp[r, e])) + 1.0
        self._stamp[r, e] = self._clock
        self._stale_rows.add(r)

    # --- learning ---------------------------------------------------------------------------------
    def _learn_step(self) -> None:
        """Fold the decode step that just ended into the layer co-occurrence and the token table."""
        routes = self._step_routes
        if (routes >= 0).all():  # every layer routed: a whole decode step
            L, k = routes.shape
            rows = np.arange(L)[:, None]
            if L > 1:
                layer = np.repeat(np.arange(L - 1), k * k)
                pairs = np.repeat(routes[:-1], k, axis=1).ravel(), np.tile(routes[1:], (1, k)).ravel()
                np.add.at(self._co, (layer, *pairs), 1)
            self._seen[rows, routes] += 1
            if self._token is not None:
                self._count_token(rows, routes)
        routes.fill(-1)

    def _count_token(self, rows: np.ndarray, routes: np.ndarray) -> None:
        """Add this step's routes [L, k] to its token's counts (rows: the layer index of each route row)."""
        entry = self._tokens.get(self._token)
        if entry is None:
            entry = self._tokens[self._token] = [np.zeros((len(self.layers), self.num_experts), np.uint8), 0]
            if len(self._tokens) > self._token_cap:
                self._tokens.popitem(last=False)  # the token seen longest ago
        else:
            self._tokens.move_to_end(self._token)
        counts = entry[0]
        if counts.max() == 255:  # saturating: halve, keeping the proportions
            counts //= 2
            entry[1] //= 2
        counts[rows, routes] += 1
        entry[1] += 1
