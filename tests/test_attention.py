"""The native decode-attention kernel against the torch reference (torch_attention) on odd shapes, both
cache dtypes, the paged cache's strided views, and any thread count; a prompt chunk's attention, native
(native_prefill_attention) and torch's split one (prefill_attention), against the same reference; and the
bf16 KV cache end to end."""

import numpy as np
import pytest
import torch

from builders import random_qwen3_moe
from mosaic_runtime import _native
from mosaic_runtime.engine import Engine
from mosaic_runtime.kv_cache import Int8Rows, KVCache, quantize_rows
from mosaic_runtime.models.base import cached_attention, native_prefill_attention, prefill_attention, torch_attention
from mosaic_shatter.convert import convert

K = _native.kernels
ATOL = 2e-6  # float32 sums in another order, and a polynomial exp within 2 ulp


def float_atol(d: int) -> float:
    """ATOL for heads up to 256 wide; wider ones sum more products in float32 (at 576, torch's own float32
    result is 3e-6 from float64's, the scalar loop's 5e-6)."""
    return ATOL if d <= 256 else ATOL * d / 128


# (query heads, KV heads, head_dim, keys): head_dim 40 takes the AVX2 loop under every x86 ISA; 80 and 112 the
# AVX-512 loop with a run-time width and an odd last slice for float32 (bf16 rows of those widths take the AVX2
# loop), 96 a run-time width for both; 64/128/256 the unrolled ones; 576 (latent attention's 512 + 64, 128 heads
# on one KV head: two tasks of 64) a run-time width wider than the integer int8 loop takes. Lengths around the
# 16-key tile and the 512-key chunk; 1 to 16 query heads a KV head, so every size of the last head block (1-4).
SHAPES = [(1, 1, 40, 1), (4, 2, 40, 37), (8, 2, 64, 1), (8, 2, 64, 15), (8, 2, 64, 16), (8, 2, 64, 17),
          (6, 3, 80, 513), (32, 4, 128, 511), (32, 4, 128, 512), (16, 2, 256, 1100), (16, 1, 128, 700),
          (64, 4, 128, 300), (2, 2, 256, 33), (3, 1, 64, 45), (5, 1, 128, 530), (6, 1, 96, 100),
          (3, 1, 112, 70), (128, 1, 576, 70)]


def int8_tolerance(ref: torch.Tensor, isa: int, d: int) -> dict:
    """assert_close's tolerance for an int8 cache's kernel output under isa: the integer loop (VNNI,
    head_dim a multiple of 32) rounds the queries and each tile's probabilities to 16 bits, so within
    3e-4 of the output's largest magnitude (9e-5 seen at most); the float loops as float_atol."""
    if isa in (K.AVX512_VNNI, K.AMX) and d % 32 == 0:
        return dict(atol=3e-4 * ref.abs().max().item(), rtol=0.0)
    return dict(atol=float_atol(d), rtol=1e-5)


# What cached_attention runs an int8 cache on (models/base.py): the integer loop where there is VNNI.
CACHED_I8_ISA = K.AVX512_VNNI if K.isa_available(K.AVX512_VNNI) else K.best_isa()


def isas():
    return [i for i in (K.SCALAR, K.AVX2, K.AVX512, K.AVX512_VNNI, K.AMX, K.AVX2_INT8, K.AVX_VNNI, K.NEON, K.NEON_DOT,
                      K.NEON_I8MM)
            if K.isa_available(i)]


@pytest.mark.parametrize("hq,hkv,d,length", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_torch(hq, hkv, d, length, dtype):
    g = torch.Generator().manual_seed(hq * 1000 + length)
    q = torch.randn(1, hq, d, generator=g)
    k = (torch.randn(hkv, length, d, generator=g) * 2).to(dtype)
    v = torch.randn(hkv, length, d, generator=g).to(dtype)
    ref = torch_attention(q, k, v, length - 1, d ** -0.5)
    torch.testing.assert_close(cached_attention(q, k, v, length - 1, d ** -0.5), ref, atol=float_atol(d), rtol=1e-5)
    fn = K.decode_attention if dtype == torch.float32 else K.decode_attention_bf16
    kk, vv = (k, v) if dtype == torch.float32 else (k.view(torch.uint16), v.view(torch.uint16))
    outs = []
    for isa in isas():
        for threads in (1, 2, 3):
            out = np.empty((hq, d), np.float32)
            fn(isa, threads, q[0].contiguous().numpy(), kk.numpy(), vv.numpy(), d ** -0.5, out)
            outs.append(out)
            torch.testing.assert_close(torch.from_numpy(out).view(1, -1), ref, atol=float_atol(d), rtol=1e-5)
    # Fixed chunks merged in order: the thread count never changes a bit (per ISA).
    per_isa = len(outs) // len(isas())
    for i in range(0, len(outs), per_isa):
        assert all(np.array_equal(outs[i], o) for o in outs[i:i + per_isa])


@pytest.mark.parametrize("hq,hkv,d,length", SHAPES)
def test_int8_kernel_matches_torch_on_the_dequantized_cache(hq, hkv, d, length):
    """An int8 cache (a code per value, a float32 scale per row): the kernel against torch_attention on
    the same cache dequantized, every ISA and 1-3 threads, bit-equal across thread counts (head_dims that
    are not a multiple of 32 take the scalar loop; under VNNI the others take the integer loop)."""
    g = torch.Generator().manual_seed(hq * 1000 + length + 1)
    q = torch.randn(1, hq, d, generator=g)
    k = Int8Rows(*quantize_rows(torch.randn(hkv, length, d, generator=g) * 2))
    v = Int8Rows(*quantize_rows(torch.randn(hkv, length, d, generator=g)))
    assert k.codes.dtype == torch.int8 and k.scales.shape == (hkv, length)
    ref = torch_attention(q, k.dequantize(), v.dequantize(), length - 1, d ** -0.5)
    torch.testing.assert_close(cached_attention(q, k, v, length - 1, d ** -0.5), ref,
                               **int8_tolerance(ref, CACHED_I8_ISA, d))
    for isa in isas():
        outs = []
        for threads in (1, 2, 3):
            out = np.empty((hq, d), np.float32)
            K.decode_attention_i8(isa, threads, q[0].contiguous().numpy(), k.codes.numpy(), v.codes.numpy(),
                                  k.scales.numpy(), v.scales.numpy(), d ** -0.5, out)
            torch.testing.assert_close(torch.from_numpy(out).view(1, -1), ref, **int8_tolerance(ref, isa, d))
            outs.append(out)
        assert all(np.array_equal(outs[0], o) for o in outs)


# (query heads, KV heads, head_dim, chunk tokens, positions before the chunk)
PREFILL_SHAPES = [(4, 2, 40, 2, 0), (4, 2, 40, 7, 5), (6, 3, 80, 33, 0), (6, 3, 80, 33, 100), (8, 1, 64, 17, 300),
                  (32, 4, 128, 64, 1000), (3, 3, 96, 5, 1)]


@pytest.mark.parametrize("hq, hkv, d, t, start", PREFILL_SHAPES)
def test_prefill_attention_matches_torch(hq, hkv, d, t, start):
    """The chunk's keys under the causal mask and the earlier ones unmasked, merged by log-sum-exp: the
    masked reference's output to float32 rounding over a float32 cache; over a bf16 cache, attended in
    bf16, within bf16's rounding of the queries (the keys and values are the cache's either way)."""
    g = torch.Generator().manual_seed(hq * 1000 + t + start)
    q = torch.randn(t, hq, d, generator=g)
    k, v = (torch.randn(hkv, start + t + 9, d, generator=g) for _ in range(2))  # the cache runs past the chunk
    ref = torch_attention(q, k, v, start, d ** -0.5)
    torch.testing.assert_close(prefill_attention(q, k, v, start, d ** -0.5), ref, atol=2e-6, rtol=1e-5)
    native = native_prefill_attention(q, k, v, start, d ** -0.5)  # where the CPU and head size let it serve
    assert torch.equal(cached_attention(q, k, v, start, d ** -0.5),
                       native if native is not None else prefill_attention(q, k, v, start, d ** -0.5))
    kb, vb = k.bfloat16(), v.bfloat16()
    ref_bf16 = torch_attention(q, kb, vb, start, d ** -0.5)
    out = prefill_attention(q, kb, vb, start, d ** -0.5)
    assert out.dtype == torch.float32 and out.shape == (t, hq * d)
    torch.testing.assert_close(out, ref_bf16, atol=2e-2, rtol=0)
    assert (out - ref_bf16).norm() < 1e-2 * ref_bf16.norm()


# (query heads, KV heads, head_dim, chunk tokens, positions before the chunk): blocks of positions cut short
# at the chunk's end, keys before it across the 512-key chunk, 1 to 65 query heads a KV head (a task takes 64
# rows: 65 go in groups of 33 and 32, one position a block), head sizes that take the AVX2 task under AVX-512.
NATIVE_PREFILL_SHAPES = [*PREFILL_SHAPES, (32, 4, 128, 21, 530), (130, 2, 32, 3, 9), (2, 2, 64, 70, 0),
                         (16, 2, 256, 9, 40)]


@pytest.mark.parametrize("hq, hkv, d, t, start", NATIVE_PREFILL_SHAPES)
def test_native_prefill_attention_matches_torch(hq, hkv, d, t, start):
    """The native prompt attention (the decode tasks a block of positions at a time) under every ISA, over
    float32, bf16 and int8 caches, against torch_attention on the same keys and values; bit-equal whatever the
    thread count; and what cached_attention runs for a prompt chunk on this CPU."""
    g = torch.Generator().manual_seed(hq * 1000 + t + start + 7)
    q = torch.randn(t, hq, d, generator=g)
    k, v = ((torch.randn(hkv, start + t + 9, d, generator=g) * s) for s in (2, 1))
    k8, v8 = Int8Rows(*quantize_rows(k)), Int8Rows(*quantize_rows(v))
    caches = {"float32": (k, v, (k.numpy(), v.numpy()), K.prefill_attention),
              "bf16": (k.bfloat16().float(), v.bfloat16().float(),
                       (k.bfloat16().view(torch.uint16).numpy(), v.bfloat16().view(torch.uint16).numpy()),
                       K.prefill_attention_bf16),
              "int8": (k8.dequantize(), v8.dequantize(),
                       (k8.codes.numpy(), v8.codes.numpy(), k8.scales.numpy(), v8.scales.numpy()),
                       K.prefill_attention_i8)}
    for name, (kf, vf, args, fn) in caches.items():
        ref = torch_attention(q, kf, vf, start, d ** -0.5)
        for isa in isas():
            outs = []
            for threads in (1, 2, 3):
                out = np.empty((t, hq * d), np.float32)
                fn(isa, threads, q.numpy(), *args, start, d ** -0.5, out)
                outs.append(out)
            # twice decode's tolerance: each block's result is rescaled as every task's is merged into it (and an
            # int8 row's scale multiplies its dot product, not each value as in the dequantized reference)
            torch.testing.assert_close(torch.from_numpy(outs[0]), ref, atol=2 * float_atol(d), rtol=1e-5,
                                       msg=lambda m: f"{name} cache, {K.isa_name(isa)}: {m}")
            assert all(np.array_equal(outs[0], o) for o in outs), (name, K.isa_name(isa))
    for kc, vc, kf, vf in ((k, v, k, v), (k8, v8, k8.dequantize(), v8.dequantize())):
        torch.testing.assert_close(cached_attention(q, kc, vc, start, d ** -0.5),
                                   torch_attention(q, kf, vf, start, d ** -0.5), atol=2 * float_atol(d), rtol=1e-5)


def test_native_prefill_attention_refuses_what_it_cannot_read():
    q = np.zeros((4, 8, 64), np.float32)
    k = np.zeros((2, 10, 64), np.float32)
    out = np.empty((4, 8 * 64), np.float32)
    isa = K.best_isa()
    K.prefill_attention(isa, 1, q, k, k, 6, 0.1, out)  # keys up to position 9: the cache holds them
    with pytest.raises(ValueError, match="prefill_attention: shapes"):
        K.prefill_attention(isa, 1, q, k, k, 7, 0.1, out)  # position 10 is past the cache
    with pytest.raises(ValueError, match="prefill_attention: shapes"):
        K.prefill_attention(isa, 1, np.zeros((4, 6, 64), np.float32), k[:1].repeat(4, 0), k[:1].repeat(4, 0), 0, 0.1,
                            np.empty((4, 6 * 64), np.float32))  # 6 query heads on 4 KV heads
    wide = np.zeros((2, 10, 128), np.float32)[:, :, :64]  # rows 128 floats apart
    with pytest.raises(ValueError, match="rows must be contiguous"):
        K.prefill_attention(isa, 1, q, wide, wide, 0, 0.1, out)


def test_int8_rows_round_trip():
    x = torch.randn(5, 3, 64) * torch.logspace(-3, 3, 5)[:, None, None]
    codes, scales = quantize_rows(x)
    assert codes.abs().max() <= 127 and (codes.abs().amax(-1) == 127).all()  # each row spans the codes
    err = (Int8Rows(codes, scales).dequantize() - x).abs()
    assert (err <= scales[..., None] / 2 + 1e-6 * x.abs()).all()  # within half a step of its row
    zero_codes, zero_scales = quantize_rows(torch.zeros(2, 8))
    assert not zero_codes.any() and not zero_scales.any()


@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_follows_a_moving_max(dtype, rising):
    """Scores that climb by about 1 a key (the kernel's reference max moves every few keys, and the
    outputs summed so far are rescaled each time), or fall from the first key (it never moves): still
    the reference softmax."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, length = 8, 1, 128, 1000
    q = torch.randn(1, hq, d, generator=g)
    ramp = torch.arange(length, dtype=torch.float32) / 100
    if not rising:
        ramp = ramp.flip(0)
    k = (q[0, :1] * ramp[:, None] + 0.1 * torch.randn(length, d, generator=g))[None].to(dtype)
    v = torch.randn(hkv, length, d, generator=g).to(dtype)
    ref = torch_attention(q, k, v, length - 1, d ** -0.5)
    fn = K.decode_attention if dtype == torch.float32 else K.decode_attention_bf16
    kk, vv = (k, v) if dtype == torch.float32 else (k.view(torch.uint16), v.view(torch.uint16))
    for isa in isas():
        out = np.empty((hq, d), np.float32)
        fn(isa, 2, q[0].contiguous().numpy(), kk.numpy(), vv.numpy(), d ** -0.5, out)
        # scores reach about 100 here, so float32 dot products in another order differ by about 1e-5
        torch.testing.assert_close(torch.from_numpy(out).view(1, -1), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_decode_over_the_paged_cache(dtype):
    """Keys through KVCache pages (a strided view of the head-major pool) and after a page gap (a gathered
    copy): the kernel reads what torch reads. An int8 cache hands back codes and row scales."""
    cache = KVCache(num_layers=2, max_seq=1024, kv_heads=2, head_dim=64, dtype=dtype, page_tokens=256)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 64, generator=g)
    k_new, v_new = torch.randn(700, 2, 64, generator=g), torch.randn(700, 2, 64, generator=g)
    k, v = cache.store(1, 0, k_new, v_new)
    dense = (lambda x: x.dequantize()) if dtype == torch.int8 else (lambda x: x)
    rows = k.codes if dtype == torch.int8 else k
    assert rows.stride(0) > rows.shape[1] * rows.shape[2]  # a view into the pool, heads far apart
    if dtype == torch.int8:  # what was stored, within half a step of each row's scale
        assert ((dense(k) - k_new.transpose(0, 1)).abs() <= k.scales[..., None] / 2 + 1e-6).all()
    ref = torch_attention(q, dense(k), dense(v), 699, 0.125)
    tol = int8_tolerance(ref, CACHED_I8_ISA, 64) if dtype == torch.int8 else dict(atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(cached_attention(q, k, v, 699, 0.125), ref, **tol)
    cache.pages = [cache.pages[0], cache.pages[2], cache.pages[1]]  # out of order: gathered
    if dtype == torch.int8:
        k = Int8Rows(cache._span(cache.k, 1, 700), cache._span(cache.k_scale, 1, 700))
        v = Int8Rows(cache._span(cache.v, 1, 700), cache._span(cache.v_scale, 1, 700))
    else:
        k, v = cache._span(cache.k, 1, 700), cache._span(cache.v, 1, 700)
    torch.testing.assert_close(cached_attention(q, k, v, 699, 0.125),
                               torch_attention(q, dense(k), dense(v), 699, 0.125), **tol)


def test_kernel_refuses_what_it_cannot_read():
    q = np.zeros((4, 64), np.float32)
    out = np.empty_like(q)
    k = np.zeros((2, 10, 64), np.float32)
    with pytest.raises(ValueError, match="shapes"):
        K.decode_attention(K.SCALAR, 1, q, k[:, :, :32], k[:, :, :32], 1.0, out)
    with pytest.raises(ValueError, match="contiguous"):
        K.decode_attention(K.SCALAR, 1, q, k[:, ::2], k[:, ::2], 1.0, out)
    with pytest.raises(ValueError, match="shapes"):  # 4 query heads do not split over 3 KV heads
        K.decode_attention(K.SCALAR, 1, q, np.zeros((3, 10, 64), np.float32), np.zeros((3, 10, 64), np.float32),
                           1.0, out)


def test_reduced_kv_caches_end_to_end(tmp_path):
    """kv_dtype="bfloat16" halves the cache, "int8" (row scales) quarters it; both move logits by the
    rounding only: same greedy tokens on this model, logits within 2e-2 (bf16) and 4e-2 (int8) of the
    float32 cache."""
    ckpt = random_qwen3_moe(tmp_path / "ckpt", seed=7, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2)
    model = convert(str(ckpt), tmp_path / "q4", "q4", progress=False).out
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    runs = {}
    for kv_dtype in ("float32", "bfloat16", "int8"):
        with Engine.open(model, max_seq=64, kv_dtype=kv_dtype, precision="exact") as engine:
            assert engine.model.state.kv.k.dtype == getattr(torch, kv_dtype)
            tokens = list(engine.generate_ids(prompt, max_new_tokens=12))
            runs[kv_dtype] = tokens, engine.logits(prompt + tokens)
    for reduced, atol in (("bfloat16", 2e-2), ("int8", 4e-2)):  # int8 rounds to 1/254 of a row's range
        assert runs["float32"][0] == runs[reduced][0]
        torch.testing.assert_close(runs[reduced][1], runs["float32"][1], atol=atol, rtol=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        Engine.open(model, max_seq=64, kv_dtype="float16")
