"""Routers as pure functions: router logits in, (topk_weights, topk_ids) out.

(topk_weights, topk_ids) is the only contract between a router and the experts (vLLM's fused_moe seam).
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE / Mixtral routing: softmax over all experts in float32, keep the top k.

    Args:
        logits: [T, E] router logits.
    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int64.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


ROUTERS = {"softmax": softmax_topk}
