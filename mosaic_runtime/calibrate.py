"""Routing counts on calibration text: how often the model's own router picks each expert of each layer.

`mosaic calibrate` writes them for `mosaic-shatter convert --routing`, which keeps the experts that carry
most of the routing at Q4 and stores the cold tail low-bit (mosaic_shatter/precision.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROUTING_FORMAT = "mosaic-routing-counts"  # mosaic_shatter.precision reads files of this format


class _Counter:
    """Stands in the model's experts seam: counts each layer's routed ids, then runs the experts."""

    def __init__(self, inner, num_experts: int):
        self.inner, self.num_experts, self.counts = inner, num_experts, {}

    def __call__(self, layer, x, topk_weights, topk_ids):
        row = self.counts.setdefault(layer, torch.zeros(self.num_experts, dtype=torch.long))
        row += torch.bincount(topk_ids.reshape(-1).long().cpu(), minlength=self.num_experts)
        return self.inner(layer, x, topk_weights, topk_ids)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def routing_counts(engine, ids: list[int], window: int) -> dict[int, list[int]]:
    """Selections per expert of every MoE layer over ids, teacher-forced in windows of `window` tokens."""
    if window < 1:
        raise ValueError("window must be at least one token")
    counter = _Counter(engine.model.experts, int(engine.arch["num_experts"]))
    engine.model.experts = counter
    try:
        for at in range(0, len(ids), window):
            engine.logits(ids[at:at + window])
    finally:
        engine.model.experts = counter.inner
    return {layer: row.tolist() for layer, row in sorted(counter.counts.items())}


def write_routing(path: str | Path, engine, counts: dict[int, list[int]], tokens: int, sources: list[str]) -> None:
    doc = {"format": ROUTING_FORMAT, "model_type": engine.arch["model_type"],
           "num_experts": engine.arch["num_experts"], "num_experts_per_tok": engine.arch["num_experts_per_tok"],
           "tokens": tokens, "text": sources, "counts": {str(layer): row for layer, row in counts.items()}}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
