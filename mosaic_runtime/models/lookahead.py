"""Router lookahead: a guess at a MoE layer's experts made one MoE layer early, while the layer before it
computes, so that their records can be read before the layer asks for them.

The guess is the next MoE layer's router applied to this layer's FFN input, re-normed with the next layer's
norm weight: the residual stream changes little from one layer to the next, so the input the next router
will see is close to this one. On the bundled model (a real trained MoE) it names 0.80 of the next layer's
top-4, its best-ranked expert 0.96 of the time. The ring policy weighs each rank of it by how often that
rank has been right (RoutingPolicy). The engine uses it when opened with router_lookahead=True: it raises
the hit rate by reading more, which on a disk-bound machine cost more than it saved (benchmarks/RESULTS.md,
"The router lookahead").
"""

from __future__ import annotations

import numpy as np
import torch

from ..ops import linear
from ..routing import choice_scores


class RouterLookahead:
    def __init__(self, model):
        recipe, layers = model.recipe.layers, model.weights.layers
        moe = [i for i, layer in enumerate(recipe) if layer.ffn.router is not None]
        # MoE layer -> (the next MoE layer, its norm weight over this one's, its router's weights and recipe)
        self._next = {}
        for a, b in zip(moe, moe[1:]):
            wa, wb = layers[a].post_norm.float(), layers[b].post_norm.float()
            renorm = torch.where(wa != 0, wb / torch.where(wa != 0, wa, 1.0), 0.0)
            self._next[a] = (renorm, layers[b].ffn, recipe[b].ffn.router)

    def guess(self, layer: int, h: np.ndarray) -> list[int] | None:
        """The experts the MoE layer after `layer` is expected to route to, from `layer`'s FFN input h
        [H] (float32, after its norm); None after the last MoE layer."""
        ids = self.guesses(layer, torch.from_numpy(h)[None])
        return None if ids is None else ids[0].tolist()

    def guesses(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
        """guess() for T tokens at once: h [T, H] float32 -> expert ids [T, k], best first."""
        nxt = self._next.get(layer)
        if nxt is None:
            return None
        renorm, ffn, router = nxt
        logits = linear(h * renorm, ffn.router)
        if ffn.router_logit_bias is not None:
            logits = logits + ffn.router_logit_bias
        _, choice = choice_scores(logits, router, ffn.router_bias)
        return torch.topk(choice, router.top_k, dim=-1).indices
