"""Large host pools (the KV cache, the backbone's weights) in anonymous memory that asks for transparent
huge pages.

The decode-attention kernel streams the whole KV cache every token. With 4 KiB pages a 32k-token
cache of one layer is 16k TLB entries a pass; 2 MiB pages (THP in its "madvise" mode, the common
default) cut that to 32 and made the kernel 10-15 % faster here. The backbone's projections stream the
same way every token; torch's own allocations are not eligible for THP in "madvise" mode, and a Q4
projection read 1.1x faster from huge pages (benchmarks/RESULTS.md). Where the system has no THP the pool
is ordinary zeroed memory.
"""

from __future__ import annotations

import math
import mmap

import torch


# Whether zeroed_pool can ask for huge pages: private anonymous maps and madvise (Linux). Elsewhere it is
# plain zeroed memory, touched at once.
HUGE_PAGES = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MADV_HUGEPAGE")


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor of `shape` on the default device; on the CPU, in its own huge-page mapping."""
    if torch.get_default_device().type != "cpu":
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # Windows has no private anonymous maps
        return torch.zeros(shape, dtype=dtype)
    # Private and anonymous: zero-filled, touched only as the pages are written, and eligible for THP
    # (a shared anonymous mapping, mmap's default, is shmem and is not).
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mapping alive (frombuffer holds a reference to its buffer).
    return torch.frombuffer(region, dtype=dtype).view(shape)


ALIGN = 64  # bytes: each tensor in an arena starts on a cache line


class HugePageArena:
    """One huge-page pool that tensors are copied into one after another (take), each a view of it.

    Its pages are touched only as tensors are copied in, so a caller that drops each original after
    taking it never holds much more than one copy."""

    def __init__(self, nbytes: int):
        self.pool = zeroed_pool((max(nbytes, 1),), torch.uint8)
        self.used = 0

    @staticmethod
    def room(t: torch.Tensor) -> int:
        """Bytes t takes in an arena, alignment included."""
        return -(-t.numel() * t.element_size() // ALIGN) * ALIGN

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in the arena (same dtype and shape, contiguous)."""
        n = t.numel() * t.element_size()
        if self.used + n > self.pool.numel():
            raise ValueError(f"arena of {self.pool.numel()} bytes is full")
        view = self.pool[self.used:self.used + n].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.used += self.room(t)
        return view
