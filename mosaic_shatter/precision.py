"""Experts at their own precision: which records a convert stores low-bit, from routing counts.

The counts come from `mosaic calibrate` (the runtime's own router over calibration text). Per MoE layer the
most-routed experts that together carry `hot_mass` of the layer's routing stay Q4_G32; the rest, the cold
tail, are stored as a low-bit type (Q3_G32 or Q2_G32) that the reader widens to Q4_G32 exactly, so a
record costs fewer bytes to read and the kernels see one layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from mosaic_runtime.calibrate import ROUTING_FORMAT
from mosaic_runtime.vault.format import LOW_BIT_NAMES, QuantType

HOT_MASS = 0.8  # the CLI's default share of each layer's routing kept at Q4_G32 (benchmarks/RESULTS.md)


class PrecisionError(ValueError):
    """A routing file that cannot decide the precision of this checkpoint's experts."""


@dataclass(frozen=True)
class RoutingCounts:
    """How often each (layer, expert) was routed on the calibration text."""

    counts: dict[int, list[int]]  # MoE layer -> selections per expert
    tokens: int
    sha256: str  # of the routing file, for the lineage and for a resume to notice a change

    @classmethod
    def load(cls, path: str | Path) -> "RoutingCounts":
        path = Path(path)
        try:
            raw = path.read_bytes()
            doc = json.loads(raw)
        except OSError as e:
            raise PrecisionError(f"{path}: {e.strerror}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PrecisionError(f"{path}: not a JSON routing file ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != ROUTING_FORMAT:
            raise PrecisionError(f"{path}: not a routing file of `mosaic calibrate` (format {ROUTING_FORMAT!r})")
        counts, tokens = doc.get("counts"), doc.get("tokens")
        if not isinstance(counts, dict) or not isinstance(tokens, int) or tokens < 1:
            raise PrecisionError(f"{path}: needs 'counts' (layer -> counts per expert) and 'tokens' (>= 1)")
        out = {}
        for layer, row in counts.items():
            if not (isinstance(layer, str) and layer.isdigit() and isinstance(row, list) and row
                    and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in row)):
                raise PrecisionError(f"{path}: layer {layer!r}: counts must be a list of non-negative integers")
            out[int(layer)] = row
        return cls(out, tokens, hashlib.sha256(raw).hexdigest())


@dataclass(frozen=True)
class MixedPrecision:
    """What a convert is asked for: the cold tail's type and the routing mass kept at Q4_G32."""

    routing: RoutingCounts
    cold: QuantType
    hot_mass: float

    @classmethod
    def of(cls, routing_path: str | Path, cold: str, hot_mass: float) -> "MixedPrecision":
        if cold not in LOW_BIT_NAMES:
            raise PrecisionError(f"cold type {cold!r}: one of {', '.join(sorted(LOW_BIT_NAMES))}")
        if not (isinstance(hot_mass, (int, float)) and math.isfinite(hot_mass) and 0.0 <= hot_mass <= 1.0):
            raise PrecisionError(f"hot mass {hot_mass!r}: a share of the routing, from 0 to 1")
        return cls(RoutingCounts.load(routing_path), LOW_BIT_NAMES[cold], float(hot_mass))

    def record_quants(self, keys: list[tuple[int, int]], num_experts: int) -> list[QuantType]:
        """Each record's type, in the order of keys ((layer, expert) of every record)."""
        layers = sorted({layer for layer, _ in keys})
        missing = [layer for layer in layers if layer not in self.routing.counts]
        if missing:
            raise PrecisionError(f"the routing file has no counts for MoE layer(s) {missing}: "
                                 "it was measured on another model")
        hot: dict[int, set[int]] = {}
        for layer in layers:
            row = self.routing.counts[layer]
            if len(row) != num_experts:
                raise PrecisionError(f"the routing file counts {len(row)} experts at layer {layer}, "
                                     f"the checkpoint has {num_experts}: it was measured on another model")
            total = sum(row)
            if total == 0:
                raise PrecisionError(f"the routing file counts no selections at layer {layer}")
            kept, mass = set(), 0
            for e in sorted(range(num_experts), key=lambda e: (-row[e], e)):
                if mass >= self.hot_mass * total or row[e] == 0:
                    break
                kept.add(e)
                mass += row[e]
            hot[layer] = kept
        return [QuantType.Q4_G32 if e in hot[layer] else self.cold for layer, e in keys]

    def lineage(self, quants: list[QuantType]) -> dict:
        """The lineage block's account of the choice (vault_format.md §7)."""
        return {"cold": self.cold.name, "hot_mass": self.hot_mass,
                "routing": {"sha256": self.routing.sha256, "tokens": self.routing.tokens},
                "records": {q.name: sum(1 for x in quants if x is q) for q in sorted(set(quants))}}
