"""A KV cache allocated once at start-up: keys and values of every attention layer up to max_seq tokens."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_seq: int, kv_heads: int, head_dim: int, dtype=torch.float32):
        self.max_seq = max_seq
        self.k = torch.zeros(num_layers, max_seq, kv_heads, head_dim, dtype=dtype)  # [L, S, Hkv, D]
        self.v = torch.zeros_like(self.k)
        self.length = 0  # tokens already held

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, Hkv, D] at positions start..start+T-1; return the layer's whole cache."""
        end = start + k.shape[0]
        if end > self.max_seq:
            raise ValueError(f"context of {end} tokens exceeds the KV cache ({self.max_seq}); open the engine "
                             "with a larger max_seq")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer], self.v[layer]

    def reset(self) -> None:
        self.length = 0

    @staticmethod
    def bytes_for(num_layers: int, max_seq: int, kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        """What a cache of these dimensions holds (keys and values), before it is allocated."""
        return 2 * num_layers * max_seq * kv_heads * head_dim * itemsize
