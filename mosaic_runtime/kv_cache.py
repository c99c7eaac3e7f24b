"""A paged KV cache: keys and values of every full-attention layer live in fixed-size pages of a pool
allocated once at start-up; a sequence takes pages from the pool as it grows and gives them back on
reset, so a long conversation grows by pages and never by reallocation.

A single sequence takes free pages lowest first, so its pages are normally one ascending run and the
attention reads them as a view; any other order is gathered (a copy) before attention.

A latent cache (multi-head latent attention) holds one row per position that serves as key and value
alike: its values are its keys' (the same pool), so it stores half of what a keys-and-values cache would.

The pool holds float32, bf16 or int8. An int8 cache keeps a float32 scale per (position, KV head) row
beside it (symmetric: amax / 127; llama.cpp's q8_0 cache keeps one per 32 values), about a quarter of
float32's bytes; its keys and values come back as Int8Rows.

Sliding-window layers keep their keys and values in a WindowCache instead, bounded whatever the context.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import torch

from .memory import zeroed_pool
from .recipe import Attention, ModelRecipe

PAGE_TOKENS = 256
# Positions a window ring holds beyond its window: the most tokens one forward may add to it, and how far a
# sequence may be cut back and still find every key its window needs (WindowCache).
WINDOW_SLACK = 1024
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # what a cache may hold


class KVRun(NamedTuple):
    """Every reserved page of every layer as one view: k, v [L, Hkv, rows, D]; an int8 cache's row scales
    k_scale, v_scale [L, Hkv, rows] (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class Int8Rows(NamedTuple):
    """Keys or values of an int8 cache over positions 0..end-1: codes [Hkv, end, D], scales [Hkv, end]."""

    codes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[..., None]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes and float32 scales of the rows of x [..., D]: code = round(x / scale), scale = amax / 127."""
    x = x.float()
    scales = x.abs().amax(-1) / 127.0
    codes = torch.round(x / scales.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


class KVCache:
    def __init__(self, num_layers: int, max_seq: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 page_tokens: int = PAGE_TOKENS, shared: bool = False):
        """shared: one row per position is key and value (a latent cache); v is k."""
        self.max_seq, self.page_tokens, self.shared = max_seq, page_tokens, shared
        n_pages = -(-max_seq // page_tokens)
        # The pool, head-major so that one head's keys over a run of pages are contiguous: attention reads
        # them in place.
        shape = (num_layers, kv_heads, n_pages, page_tokens, head_dim)
        self.k = zeroed_pool(shape, dtype)
        self.v = self.k if shared else zeroed_pool(shape, dtype)
        self.quantized = dtype == torch.int8
        if self.quantized:  # a scale per row, laid out as the rows are
            self.k_scale = zeroed_pool(shape[:4], torch.float32)
            self.v_scale = self.k_scale if shared else zeroed_pool(shape[:4], torch.float32)
        self.free = list(range(n_pages))  # a heap: lowest page first
        self.pages: list[int] = []  # the sequence's page table: logical page -> pool page

    def _reserve(self, end: int) -> None:
        if end > self.max_seq:
            raise ValueError(f"context of {end} tokens exceeds the KV cache ({self.max_seq}); open the engine "
                             "with a larger max_seq")
        while len(self.pages) * self.page_tokens < end:
            self.pages.append(heapq.heappop(self.free))

    def _span(self, pool: torch.Tensor, layer: int, end: int) -> torch.Tensor:
        """Positions 0..end-1 of one layer as [Hkv, end, D] (a scale pool: [Hkv, end]): a view when the
        pages are one ascending run."""
        n = -(-end // self.page_tokens)
        first, pages = self.pages[0], self.pages[:n]
        heads, row = pool.shape[1], pool.shape[4:]
        if pages == list(range(first, first + n)):
            return pool[layer, :, first:first + n].reshape(heads, -1, *row)[:, :end]
        return pool[layer][:, pages].reshape(heads, -1, *row)[:, :end]

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor | None):
        """Write k, v [T, Hkv, D] at positions start..start+T-1 (a shared cache: k alone, v None); return
        the layer's keys and values for positions 0..start+T-1, head-major: [Hkv, start+T, D] (an int8
        cache: as Int8Rows)."""
        end = start + k.shape[0]
        self._reserve(end)
        if self.quantized:
            k, k_scale = quantize_rows(k)
            if not self.shared:
                v, v_scale = quantize_rows(v)
        pos = start
        while pos < end:  # page by page
            page, offset = divmod(pos, self.page_tokens)
            n = min(self.page_tokens - offset, end - pos)
            rows = slice(pos - start, pos - start + n)
            where = (layer, slice(None), self.pages[page], slice(offset, offset + n))
            self.k[where] = k[rows].transpose(0, 1)
            if self.quantized:
                self.k_scale[where] = k_scale[rows].transpose(0, 1)
            if not self.shared:
                self.v[where] = v[rows].transpose(0, 1)
                if self.quantized:
                    self.v_scale[where] = v_scale[rows].transpose(0, 1)
            pos += n
        if self.quantized:
            return (Int8Rows(self._span(self.k, layer, end), self._span(self.k_scale, layer, end)),
                    Int8Rows(self._span(self.v, layer, end), self._span(self.v_scale, layer, end)))
        return self._span(self.k, layer, end), self._span(self.v, layer, end)

    def contiguous_run(self) -> KVRun | None:
        """Keys and values of every reserved page, all layers, as [L, Hkv, pages * page_tokens, D] views
        (an int8 cache's scales as [L, Hkv, pages * page_tokens]) when the pages are one ascending run
        (position p is row p), else None."""
        n = len(self.pages)
        if n == 0 or self.pages != list(range(self.pages[0], self.pages[0] + n)):
            return None
        first = self.pages[0]
        layers, heads = self.k.shape[0], self.k.shape[1]

        def run(pool: torch.Tensor) -> torch.Tensor:
            return pool[:, :, first:first + n].reshape(layers, heads, -1, *pool.shape[4:])

        if self.quantized:
            return KVRun(run(self.k), run(self.v), run(self.k_scale), run(self.v_scale))
        return KVRun(run(self.k), run(self.v))

    def reserve(self, end: int) -> None:
        """Take pages from the pool until positions 0..end-1 have room (a step that writes them itself)."""
        self._reserve(end)

    def reset(self) -> None:
        """Give every page back to the pool."""
        for page in self.pages:
            heapq.heappush(self.free, page)
        self.pages.clear()

    @property
    def pages_in_use(self) -> int:
        return len(self.pages)

    @property
    def page_bytes(self) -> int:
        """What one page holds over every layer: keys, values and (int8) their row scales."""
        layers, heads, _, tokens, dim = self.k.shape
        return self.bytes_for(layers, tokens, heads, dim, self.k.element_size(), page_tokens=tokens,
                              shared=self.shared)

    @staticmethod
    def bytes_for(num_layers: int, max_seq: int, kv_heads: int, head_dim: int, itemsize: int = 4,
                  page_tokens: int = PAGE_TOKENS, shared: bool = False) -> int:
        """What a pool of these dimensions holds (keys and values, or a shared cache's one row; int8,
        itemsize 1: and their float32 row scales), before it is allocated."""
        row = head_dim * itemsize + (4 if itemsize == 1 else 0)
        return (1 if shared else 2) * num_layers * (-(-max_seq // page_tokens)) * page_tokens * kv_heads * row


def windowed_layers(recipe: ModelRecipe, max_seq: int) -> list[int]:
    """The sliding-window layers whose keys and values go into a WindowCache: all of them when its ring
    (twice window + slack positions a layer) is smaller than max_seq, else none (a short context keeps
    them in the KV cache, which then holds no more)."""
    windowed = [i for i in recipe.attention_layers
                if isinstance(recipe.layers[i].mixer, Attention) and recipe.layers[i].mixer.sliding_window]
    if not windowed or 2 * (recipe.layers[windowed[0]].mixer.sliding_window + WINDOW_SLACK) >= max_seq:
        return []
    return windowed


class WindowCache:
    """Keys and values of sliding-window attention layers, bounded at any context: a ring of
    rows = window + slack positions per layer (position p at row p % rows), each row written twice, at r and
    at r + rows, so that any run of up to `rows` consecutive positions is one contiguous span of the 2 x rows
    buffer. Attention reads a window in place that way, in the torch path and in the native step alike.

    One forward may add at most slack + 1 positions (store()); a sequence of length L may continue from any
    start >= L - slack - 1 (resumable()): the keys its window needs are still in the ring.
    """

    def __init__(self, num_layers: int, window: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 slack: int = WINDOW_SLACK):
        self.window, self.slack, self.rows = window, slack, window + slack
        shape = (num_layers, kv_heads, 2 * self.rows, head_dim)
        self.k, self.v = zeroed_pool(shape, dtype), zeroed_pool(shape, dtype)
        self.quantized = dtype == torch.int8
        if self.quantized:
            self.k_scale, self.v_scale = zeroed_pool(shape[:3], torch.float32), zeroed_pool(shape[:3], torch.float32)

    def resumable(self, start: int, length: int) -> bool:
        """Whether a sequence holding `length` positions can continue from `start` (<= length)."""
        return start >= length - self.slack - 1

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, Hkv, D] at positions start..start+T-1 (T <= slack + 1); return (keys, values, lo):
        the layer's rows for positions lo..start+T-1, lo = max(0, start - window + 1), head-major
        [Hkv, start+T-lo, D] (an int8 cache: as Int8Rows), a view."""
        t = k.shape[0]
        if t > self.slack + 1:
            raise ValueError(f"{t} positions in one step; a window ring takes at most {self.slack + 1}")
        end = start + t
        rows = torch.arange(start, end) % self.rows
        twice = torch.cat([rows, rows + self.rows])
        if self.quantized:
            (k, k_scale), (v, v_scale) = quantize_rows(k), quantize_rows(v)
            self.k_scale[layer][:, twice] = k_scale.T.repeat(1, 2)
            self.v_scale[layer][:, twice] = v_scale.T.repeat(1, 2)
        self.k[layer][:, twice] = k.transpose(0, 1).repeat(1, 2, 1).to(self.k.dtype)
        self.v[layer][:, twice] = v.transpose(0, 1).repeat(1, 2, 1).to(self.v.dtype)
        lo = max(0, start - self.window + 1)
        span = slice(lo % self.rows, lo % self.rows + end - lo)
        if self.quantized:
            return (Int8Rows(self.k[layer][:, span], self.k_scale[layer][:, span]),
                    Int8Rows(self.v[layer][:, span], self.v_scale[layer][:, span]), lo)
        return self.k[layer][:, span], self.v[layer][:, span], lo

    def run(self) -> KVRun:
        """Every layer's buffer, [L, Hkv, 2 * rows, D] (an int8 cache's scales [L, Hkv, 2 * rows]), for the
        native step."""
        if self.quantized:
            return KVRun(self.k, self.v, self.k_scale, self.v_scale)
        return KVRun(self.k, self.v)

    @staticmethod
    def bytes_for(num_layers: int, window: int, kv_heads: int, head_dim: int, itemsize: int = 4,
                  slack: int = WINDOW_SLACK) -> int:
        row = head_dim * itemsize + (4 if itemsize == 1 else 0)
        return 2 * num_layers * 2 * (window + slack) * kv_heads * row
