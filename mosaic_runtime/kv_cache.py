"""A paged KV cache: keys and values of every full-attention layer live in fixed-size pages of a pool
allocated once at start-up; a sequence takes pages from the pool as it grows and gives them back on
reset, so a long conversation grows by pages and never by reallocation.

A single sequence takes free pages lowest first, so its pages are normally one ascending run and the
attention reads them as a view; any other order is gathered (a copy) before attention.
"""

from __future__ import annotations

import heapq

import torch

from .memory import zeroed_pool

PAGE_TOKENS = 256


class KVCache:
    def __init__(self, num_layers: int, max_seq: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 page_tokens: int = PAGE_TOKENS):
        self.max_seq, self.page_tokens = max_seq, page_tokens
        n_pages = -(-max_seq // page_tokens)
        # The pool, head-major so that one head's keys over a run of pages are contiguous: attention reads
        # them in place.
        shape = (num_layers, kv_heads, n_pages, page_tokens, head_dim)
        self.k, self.v = zeroed_pool(shape, dtype), zeroed_pool(shape, dtype)
        self.free = list(range(n_pages))  # a heap: lowest page first
        self.pages: list[int] = []  # the sequence's page table: logical page -> pool page
        self.length = 0  # tokens already held

    def _reserve(self, end: int) -> None:
        if end > self.max_seq:
            raise ValueError(f"context of {end} tokens exceeds the KV cache ({self.max_seq}); open the engine "
                             "with a larger max_seq")
        while len(self.pages) * self.page_tokens < end:
            self.pages.append(heapq.heappop(self.free))

    def _span(self, pool: torch.Tensor, layer: int, end: int) -> torch.Tensor:
        """Positions 0..end-1 of one layer as [Hkv, end, D]: a view when the pages are one ascending run."""
        n = -(-end // self.page_tokens)
        first, pages = self.pages[0], self.pages[:n]
        heads, dim = pool.shape[1], pool.shape[4]
        if pages == list(range(first, first + n)):
            return pool[layer, :, first:first + n].reshape(heads, -1, dim)[:, :end]
        return pool[layer][:, pages].reshape(heads, -1, dim)[:, :end]

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, Hkv, D] at positions start..start+T-1; return the layer's keys and values for
        positions 0..start+T-1, head-major: [Hkv, start+T, D]."""
        end = start + k.shape[0]
        self._reserve(end)
        pos = start
        while pos < end:  # page by page
            page, offset = divmod(pos, self.page_tokens)
            n = min(self.page_tokens - offset, end - pos)
            self.k[layer, :, self.pages[page], offset:offset + n] = k[pos - start:pos - start + n].transpose(0, 1)
            self.v[layer, :, self.pages[page], offset:offset + n] = v[pos - start:pos - start + n].transpose(0, 1)
            pos += n
        return self._span(self.k, layer, end), self._span(self.v, layer, end)

    def contiguous_run(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values of every reserved page, all layers, as [L, Hkv, pages * page_tokens, D] views
        when the pages are one ascending run (position p is row p), else None."""
        n = len(self.pages)
        if n == 0 or self.pages != list(range(self.pages[0], self.pages[0] + n)):
            return None
        first = self.pages[0]
        layers, heads, dim = self.k.shape[0], self.k.shape[1], self.k.shape[4]
        return (self.k[:, :, first:first + n].reshape(layers, heads, -1, dim),
                self.v[:, :, first:first + n].reshape(layers, heads, -1, dim))

    def reserve(self, end: int) -> None:
        """Take pages from the pool until positions 0..end-1 have room (a step that writes them itself)."""
        self._reserve(end)

    def reset(self) -> None:
        """Give every page back to the pool."""
        for page in self.pages:
            heapq.heappush(self.free, page)
        self.pages.clear()
        self.length = 0

    @property
    def pages_in_use(self) -> int:
        return len(self.pages)

    @staticmethod
    def bytes_for(num_layers: int, max_seq: int, kv_heads: int, head_dim: int, itemsize: int = 4,
                  page_tokens: int = PAGE_TOKENS) -> int:
        """What a pool of these dimensions holds (keys and values), before it is allocated."""
        return 2 * num_layers * (-(-max_seq // page_tokens)) * page_tokens * kv_heads * head_dim * itemsize
