"""The paged KV cache against a dense reference: any sequence of writes, pages in any order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_runtime.kv_cache import KVCache


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8), page=st.sampled_from([1, 4, 16]),
       shuffled=st.booleans(), seed=st.integers(0, 100))
def test_pages_hold_what_a_dense_cache_would(chunks, page, shuffled, seed):
    total = sum(chunks)
    cache = KVCache(2, total + 5, 2, 3, page_tokens=page)
    if shuffled:  # pages handed out in a scrambled order: the span must be gathered
        cache.free = torch.randperm(len(cache.free), generator=torch.Generator().manual_seed(seed)).tolist()
    pool = cache.k.data_ptr()
    g = torch.Generator().manual_seed(seed)
    dense_k, dense_v, start = torch.zeros(total, 2, 3), torch.zeros(total, 2, 3), 0
    for n in chunks:
        k, v = torch.randn(n, 2, 3, generator=g), torch.randn(n, 2, 3, generator=g)
        dense_k[start:start + n], dense_v[start:start + n] = k, v
        for layer in (0, 1):
            got_k, got_v = cache.store(layer, start, k * (layer + 1), v * (layer + 1))
            assert torch.equal(got_k, dense_k[:start + n].transpose(0, 1) * (layer + 1))  # head-major
            assert torch.equal(got_v, dense_v[:start + n].transpose(0, 1) * (layer + 1))
        start += n
    assert cache.pages_in_use == -(-total // page) and cache.k.data_ptr() == pool  # grew by pages, in place


def test_reset_gives_pages_back_lowest_first():
    cache = KVCache(1, 64, 1, 2, page_tokens=16)
    cache.store(0, 0, torch.ones(40, 1, 2), torch.ones(40, 1, 2))
    assert cache.pages == [0, 1, 2]
    cache.reset()
    assert cache.pages_in_use == 0 and sorted(cache.free) == [0, 1, 2, 3]
    k, _ = cache.store(0, 0, torch.full((20, 1, 2), 2.0), torch.ones(20, 1, 2))
    assert cache.pages == [0, 1] and k._base is not None  # one ascending run: a view, not a copy


def test_longer_than_the_pool_is_refused():
    cache = KVCache(1, 32, 1, 2, page_tokens=16)
    with pytest.raises(ValueError, match="max_seq"):
        cache.store(0, 30, torch.ones(3, 1, 2), torch.ones(3, 1, 2))
