"""What a sequence leaves behind: a KV cache for the attention layers only (one latent row per position for
latent attention), sliding-window layers' keys and values in a ring bounded by their window (when max_seq
is long enough for that to save memory), and per Gated DeltaNet layer its conv window and recurrent state.
Allocated once, at the size the recipe and max_seq give; the model reports that size before allocating it
(bytes_for), so the engine gives the expert ring the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kv_cache import KVCache, WindowCache, windowed_layers
from ..recipe import ModelRecipe


@dataclass(frozen=True)
class StateSnapshot:
    length: int
    conv: torch.Tensor | None
    recurrent: torch.Tensor | None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent) if t is not None)


class SequenceState:
    def __init__(self, recipe: ModelRecipe, max_seq: int, kv_dtype: torch.dtype = torch.float32):
        att, delta = recipe.attention, recipe.delta_layers
        self._max_seq = max_seq
        self.windowed = windowed_layers(recipe, max_seq)
        full = [i for i in recipe.attention_layers if i not in self.windowed]
        self.kv, self.window = None, None
        if full:
            heads, dim, shared = att.cache_geometry
            self.kv = KVCache(len(full), max_seq, heads, dim, kv_dtype, shared=shared)
        if self.windowed:
            heads, dim, _ = att.cache_geometry
            self.window = WindowCache(len(self.windowed), recipe.layers[self.windowed[0]].mixer.sliding_window,
                                      heads, dim, kv_dtype)
        # slot[i]: layer i's row in the KV cache, the window cache or the DeltaNet states
        self.slot = [0] * len(recipe.layers)
        for kind in (full, self.windowed, delta):
            for row, layer in enumerate(kind):
                self.slot[layer] = row
        dn = recipe.layers[delta[0]].mixer if delta else None
        self.conv = torch.zeros(len(delta), dn.channels, dn.conv_kernel - 1) if dn else None  # oldest input first
        self.recurrent = torch.zeros(len(delta), dn.value_heads, dn.key_dim, dn.value_dim) if dn else None
        self.length = 0  # tokens the state holds

    @property
    def max_seq(self) -> int:
        return self._max_seq

    @property
    def rewindable(self) -> bool:
        """A recurrent state cannot be cut back to a prefix: a conversation keeps all of it or none."""
        return self.recurrent is None

    def resumable(self, start: int) -> bool:
        """Whether the state can continue from position start: its end, or (no recurrent state) a prefix of
        what it holds that a window ring still covers."""
        if start == self.length:
            return True
        if start > self.length or not self.rewindable:
            return False
        return self.window is None or self.window.resumable(start, self.length)

    @property
    def max_step(self) -> int | None:
        """The most positions one forward may add (a window ring's bound), or None."""
        return self.window.slack + 1 if self.window is not None else None

    def reset(self) -> None:
        if self.kv is not None:
            self.kv.reset()
        if self.recurrent is not None:
            self.conv.zero_()
            self.recurrent.zero_()
        self.length = 0

    def snapshot(self) -> "StateSnapshot":
        """What restore() needs to bring the state back to its present length: the recurrent layers' state
        copied (it cannot be cut back); the KV cache is not copied, its positions below length stay valid
        as long as the caller feeds nothing different before them."""
        if self.recurrent is None:
            return StateSnapshot(self.length, None, None)
        return StateSnapshot(self.length, self.conv.clone(), self.recurrent.clone())

    def restore(self, snap: "StateSnapshot") -> None:
        """Back to a snapshot taken of this state, whose tokens the KV cache still holds (see snapshot)."""
        if snap.length > self.length:
            raise ValueError(f"a snapshot at {snap.length} tokens cannot restore a state holding {self.length}")
        if self.recurrent is not None:
            self.conv.copy_(snap.conv)
            self.recurrent.copy_(snap.recurrent)
        self.length = snap.length

    @property
    def state_bytes(self) -> int:
        """The DeltaNet layers' conv windows and recurrent states: constant, whatever the context."""
        if self.recurrent is None:
            return 0
        return (self.conv.numel() + self.recurrent.numel()) * self.recurrent.element_size()

    @staticmethod
    def bytes_for(recipe: ModelRecipe, max_seq: int, kv_dtype: torch.dtype) -> int:
        """What a state for this recipe and max_seq holds, before it is allocated."""
        att = recipe.attention
        total = 0
        windowed = windowed_layers(recipe, max_seq)
        if att is not None:
            heads, dim, shared = att.cache_geometry
            full = len(recipe.attention_layers) - len(windowed)
            if full:
                total += KVCache.bytes_for(full, max_seq, heads, dim, kv_dtype.itemsize, shared=shared)
            if windowed:
                total += WindowCache.bytes_for(len(windowed), recipe.layers[windowed[0]].mixer.sliding_window,
                                               heads, dim, kv_dtype.itemsize)
        for i in recipe.delta_layers:
            dn = recipe.layers[i].mixer
            total += 4 * (dn.channels * (dn.conv_kernel - 1) + dn.value_heads * dn.key_dim * dn.value_dim)
        return total
