"""Expert executors: run the routed experts of one layer for (x, topk_weights, topk_ids).

Model files call an executor and know nothing of vaults, rings or devices. Every executor accumulates
experts in ascending expert id, whatever order their weights became available in, so results never
depend on timing (and match transformers' own loop order).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F

ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate [I, H], up [I, H], down [H, I]


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k], topk_ids [T, k] -> sum_k w * expert(x), [T, H]."""


def expert_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for x [n, H]: the torch reference of the native kernels."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class TorchExperts:
    """Runs experts with torch ops on float32 weights supplied by `fetch(layer, expert)`."""

    def __init__(self, fetch: Callable[[int, int], ExpertWeights]):
        self.fetch = fetch

    def __call__(self, layer, x, topk_weights, topk_ids):
        y = torch.zeros_like(x)
        for e in torch.unique(topk_ids).tolist():  # ascending
            tokens, slot = torch.where(topk_ids == e)
            out = expert_ffn(x[tokens], *self.fetch(layer, e))
            y.index_add_(0, tokens, out * topk_weights[tokens, slot, None].to(x.dtype))
        return y
