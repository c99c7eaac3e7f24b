"""Routers as pure functions: router logits in, (topk_weights, topk_ids) out.

(topk_weights, topk_ids) is the only contract between a router and the experts (vLLM's fused_moe seam).
The native decode step computes the same in native/src/decode_layer.cpp; this is its reference.
"""

from __future__ import annotations

import torch

from .recipe import Router, Scoring, TopkMethod


def route(logits: torch.Tensor, router: Router, score_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every router kind of the recipes, in float32 (as transformers computes them).

    Scores are the softmax (Qwen, Mixtral, OLMoE, DeepSeek-V2) or the sigmoid (DeepSeek-V3, GLM-4.5) of the
    logits. The experts chosen are the top k of the scores plus score_bias (the correction bias, which picks
    experts but never weighs them), among the best topk_group of n_group groups when the method limits
    groups; their weights are their scores, renormalised when norm_topk_prob, times the scaling factor.

    Args:
        logits: [T, E] router logits.
    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int64.
    """
    scores, choice = choice_scores(logits, router, score_bias)
    ids = torch.topk(choice, router.top_k, dim=-1).indices  # [T, k], best first
    weights = scores.gather(1, ids)
    if router.norm_topk_prob:
        # + 1e-20 where transformers adds it (the sigmoid routers): a zero sum cannot happen under softmax
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if router.scoring is Scoring.SIGMOID else 0.0))
    return weights * router.scaling, ids


def choice_scores(logits: torch.Tensor, router: Router, score_bias: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E], what the experts are chosen by [T, E]: scores + bias, -inf outside the best groups)."""
    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if router.scoring is Scoring.SOFTMAX else torch.sigmoid(logits)  # [T, E]
    choice = scores if score_bias is None else scores + score_bias.float()
    if router.method is not TopkMethod.GREEDY and router.n_group > 1:
        t, e = choice.shape
        groups = choice.view(t, router.n_group, e // router.n_group)
        if router.method is TopkMethod.NOAUX_TC:  # a group's worth: the sum of its two best
            group_scores = groups.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = groups.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(router.topk_group, dim=-1).indices, True)  # [T, groups]
        choice = choice.masked_fill(~keep[:, :, None].expand_as(groups).reshape(t, e), float("-inf"))
    return scores, choice
