"""Routing traces of real models, and the expert ring simulated on them.

Loaders for the public traces in ../shared/routing (DeepSeek-V2-Lite-Chat prefill of prompt text, with
its tokens; Mixtral-8x7B-Instruct greedy decode, without them). They carry no licence: benchmarks read
them from there; nothing here copies them into the repository.

`ring_hit_rate` drives a ring policy exactly as ExpertStore does in a decode step: per token
`begin_step(token)`, then layer by layer `routed`, the lookups (held records pinned before any miss takes a
slot), the misses placed, and `plan_ahead` for the next layer while this one computes (with a router
lookahead's guess, as `Engine.open(router_lookahead=True)` gives it, where asked for and the trace records
one: the bundled model's, benchmarks/routing_bench.py). `belady_hit_rate` is the bound for a ring of the same
size that reads only on demand: it evicts the record whose next use is farthest away, knowing the future.
"""

from __future__ import annotations

import csv
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Trace:
    name: str
    kind: str
    n_experts: int
    top_k: int
    sequences: list[np.ndarray]  # each [T, L, k] expert ids
    tokens: list[list[int]] = field(default_factory=list)  # per sequence, per token: an id (empty: unknown)
    # per sequence [T, L, k]: a router lookahead's guess at each layer's experts, made while the layer before
    # it computed (layer 0's unused); empty: none
    guesses: list[np.ndarray] = field(default_factory=list)

    @property
    def layers(self) -> int:
        return self.sequences[0].shape[1]

    @property
    def tokens_total(self) -> int:
        return sum(s.shape[0] for s in self.sequences)

    def steps(self):
        """(token id or None, routes [L, k], guesses [L, k] or None) for every token of every sequence, in
        order."""
        for i, s in enumerate(self.sequences):
            ids = self.tokens[i] if self.tokens else [None] * s.shape[0]
            for t in range(s.shape[0]):
                yield ids[t], s[t], self.guesses[i][t] if self.guesses else None


def token_id(text: str, vocab: int = 1 << 30) -> int:
    """A stable id for a token's text (the traces give text, not the model's ids)."""
    return zlib.crc32(text.encode("utf-8")) % vocab


def deepseek_trace(folder: Path, vocab: int = 1 << 30) -> Trace:
    """DeepSeek-V2-Lite-Chat: per-file CSVs, rows grouped by layer (1..26), then token order."""
    sequences, tokens = [], []
    for path in sorted(folder.rglob("*.csv")):
        by_layer: dict[int, list[list[int]]] = {}
        text: dict[int, list[str]] = {}
        with path.open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                layer = int(row["Layer ID"])
                by_layer.setdefault(layer, []).append(json.loads(row["Activated Expert IDs"]))
                text.setdefault(layer, []).append(row["Token"])
        lengths = {len(v) for v in by_layer.values()}
        if len(by_layer) != 26 or len(lengths) != 1:
            continue  # an incomplete file
        sequences.append(np.array([by_layer[layer] for layer in sorted(by_layer)]).transpose(1, 0, 2))
        tokens.append([token_id(t, vocab) for t in text[min(text)]])
    return Trace("DeepSeek-V2-Lite-Chat", "prompts, teacher-forced prefill", 64, 6, sequences, tokens)


def mixtral_trace(folder: Path) -> Trace:
    """Mixtral-8x7B-Instruct: decode tokens, one JSONL record per (problem, layer, token); no token ids."""
    rows: dict[tuple[str, int], dict[tuple[int, int], list[int]]] = {}
    for path in sorted(folder.glob("*_2_routing.jsonl")):
        for line in path.open(encoding="utf-8"):
            r = json.loads(line)
            rows.setdefault((r["dataset"], r["problem_id"]), {})[(r["token_idx"], r["layer"])] = r["experts"]
    sequences = []
    for cells in rows.values():
        n_tok = 1 + max(t for t, _ in cells)
        full = [t for t in range(n_tok) if all((t, layer) in cells for layer in range(32))]
        sequences.append(np.array([[cells[(t, layer)] for layer in range(32)] for t in full]))
    return Trace("Mixtral-8x7B-Instruct", "greedy decode", 8, 2, sequences)


def load(name: str, routing: Path) -> Trace:
    if name == "deepseek-v2-lite":
        return deepseek_trace(routing / "deepseek-v2-lite")
    if name == "mixtral-8x7b":
        return mixtral_trace(routing / "mixtral-8x7b")
    raise ValueError(f"unknown trace {name!r}: deepseek-v2-lite or mixtral-8x7b")


@dataclass
class RingRun:
    hit_rate: float
    reads_per_token: float  # records read, read-ahead included
    ahead_per_token: float
    ahead_used: float  # share of read-ahead records a layer then asked for
    bytes_per_token: float = 0.0  # with record_bytes: the stored bytes of those reads


def ring_hit_rate(policy, trace: Trace, record_bytes: np.ndarray | None = None, lookahead: bool = False) -> RingRun:
    """Drive `policy` (a cache.policy.RingPolicy) over the trace as ExpertStore would, token by token; with
    lookahead, the trace's router lookahead guesses go to the read-ahead where it has them.
    record_bytes: [layers, experts] stored size of each record, to count the bytes the reads take."""
    layers = trace.layers
    reads_ahead = layers * trace.n_experts > policy.usable  # as ExpertStore.read_ahead: not when all fit
    hits = lookups = reads = ahead = used = read_bytes = 0
    pending: set[tuple[int, int]] = set()  # read ahead, not yet asked for
    for token, routes, guesses in trace.steps():
        policy.begin_step(token)
        for layer in range(layers):
            experts = sorted(set(routes[layer].tolist()))
            policy.routed(layer, experts)
            found = [policy.lookup((layer, e)) for e in experts]
            pinned = {s for s in found if s is not None}
            for e, slot in zip(experts, found):
                if (layer, e) in pending:
                    pending.discard((layer, e))
                    used += 1
                if slot is None:
                    pinned.add(policy.place((layer, e), pinned))
                    reads += 1
                    read_bytes += 0 if record_bytes is None else int(record_bytes[layer, e])
            hits += sum(s is not None for s in found)
            lookups += len(experts)
            if reads_ahead and layer + 1 < layers:
                guess = guesses[layer + 1].tolist() if lookahead and guesses is not None else None
                planned = policy.plan_ahead(layer + 1, pinned, guess)
                pending.difference_update(k for k in list(pending) if k not in policy.where)
                pending.update(k for k, _ in planned)
                ahead += len(planned)
                reads += len(planned)
                if record_bytes is not None:
                    read_bytes += sum(int(record_bytes[layer + 1, e]) for (_, e), _ in planned)
    n = trace.tokens_total
    return RingRun(hits / lookups, reads / n, ahead / n, used / ahead if ahead else 0.0, read_bytes / n)


def belady_hit_rate(trace: Trace, slots: int) -> float:
    """Hit rate of a demand-read ring of `slots` records that evicts the one used farthest in the future
    (never one the current layer needs)."""
    steps = np.concatenate(trace.sequences)  # [N, L, k]
    n, layers, _ = steps.shape
    E = trace.n_experts
    # next_use[t, l, e]: the first step after t that uses (l, e), else n (never)
    next_use = np.empty((n, layers, E), np.int32)
    upcoming = np.full((layers, E), n, np.int32)
    for t in range(n - 1, -1, -1):
        next_use[t] = upcoming
        upcoming[np.arange(layers)[:, None], steps[t]] = t
    held = np.zeros((layers, E), bool)
    due = np.full((layers, E), -1, np.int64)  # a held record's next use, as an order (step * layers + layer)
    count = hits = lookups = 0
    for t in range(n):
        for layer in range(layers):
            need = np.unique(steps[t, layer])
            hit = held[layer, need]
            hits += int(hit.sum())
            lookups += len(need)
            missing = need[~hit]
            over = count + len(missing) - slots
            if over > 0:
                order = np.where(held, due, -1).astype(np.float64)
                order[layer, need] = -1
                victims = np.argpartition(-order.ravel(), over - 1)[:over]
                held.ravel()[victims] = False
                count -= over
            held[layer, missing] = True
            count += len(missing)
            due[layer, need] = next_use[t, layer, need].astype(np.int64) * layers + layer
    return hits / lookups
