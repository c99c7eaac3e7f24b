"""The native decode step (native/src/decode_layer.cpp: a layer's mixer, router and MLP in one call;
decode_token.cpp: the layer loop, experts included) against the torch path it replaces, for every backbone
precision, dense and MoE layers, and a cache whose pages are out of order (which falls back to the torch
path). tests/test_families.py holds every family's recipe to the same."""

import pytest
import torch

from builders import random_qwen3_moe
from mosaic_runtime.engine import Engine
from mosaic_runtime.kv_cache import KVCache
from mosaic_shatter.convert import convert
from reference import StepSpy

PROMPT = [5, 17, 101, 64, 3, 250, 77, 9]
STEPS = 10
ATOL = 2e-5  # float32 in another order (norms, softmax, attention); logits are O(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layer")
    # 6 query heads: q, k and v have 96 + 32 + 32 rows, so the threads' even split of them (two or three
    # threads) falls inside a matrix, not on a boundary
    ckpt = random_qwen3_moe(root / "ckpt", seed=11, eos_token_id=None, num_experts=8, num_experts_per_tok=3,
                            num_hidden_layers=3, mlp_only_layers=[1], num_attention_heads=6)
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def decode(engine, native: bool):
    engine.model.use_native_decode = native
    logits = [engine.logits(PROMPT)[-1]]
    for _ in range(STEPS):
        logits.append(engine.model.forward(torch.tensor([int(logits[-1].argmax())]), engine.model.state.length)[-1])
    return torch.stack(logits)


@pytest.mark.parametrize("backbone", ["bf16", "int8", "fp8", "q4"])
@pytest.mark.parametrize("threads", [2, 3])
def test_native_decode_step_matches_the_torch_path(model_dir, backbone, threads):
    with Engine.open(model_dir, max_seq=64, precision="exact", backbone=backbone, threads=threads) as engine:
        assert engine.model.native is not None
        native, reference = decode(engine, True), decode(engine, False)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_dtype, atol", [("bfloat16", 1e-4), ("int8", 1e-3)])
def test_native_decode_step_on_a_rounded_cache_matches_the_torch_path(model_dir, kv_dtype, atol):
    """A bf16 or int8 KV cache: the native step rounds each new row as KVCache.store does and attends
    through the same kernels. A value computed in another float order can land on the other side of a
    rounding boundary (a bf16 step; under VNNI, the int8 attention's 16-bit query and probability codes
    too: seen 3.5e-4), so logits are held to atol, not ATOL."""
    with Engine.open(model_dir, max_seq=64, kv_dtype=kv_dtype, precision="exact") as engine:
        assert engine.model.native is not None
        native, reference = decode(engine, True), decode(engine, False)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(native, reference, atol=atol, rtol=0)


def cache_rows(kv):
    """The cache's keys and values as float32 [layers, Hkv, pages, rows, D], one code step per value (an
    int8 cache's scale; zero otherwise), and the stored elements as they are (codes, bf16 or float32)."""
    kv = kv.kv
    if not kv.quantized:
        return kv.k.float(), kv.v.float(), torch.zeros(()), torch.zeros(()), kv.k.clone()
    return (kv.k.float() * kv.k_scale[..., None], kv.v.float() * kv.v_scale[..., None], kv.k_scale[..., None],
            kv.v_scale[..., None], kv.k.clone())


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_native_step_is_used_and_writes_the_same_cache(model_dir, kv_dtype):
    """Every layer of every step goes through one native call, the dense layer included; the cache it
    writes is the torch path's: float32 within float rounding, bf16 within one bf16 step (2^-7 relative),
    int8 within one code step."""
    pools = {}
    for native in (True, False):
        with Engine.open(model_dir, max_seq=64, kv_dtype=kv_dtype, precision="exact") as engine:
            engine.finish_preload()  # every record held: one native call a step, experts included
            spy = engine.model.native.step_fn = StepSpy(engine.model.native.step_fn, len(engine.model.layers))
            decode(engine, native)
            assert spy.ran == (list(range(len(engine.model.layers))) * STEPS if native else [])
            assert spy.calls == (STEPS if native else 0)
            pools[native] = cache_rows(engine.model.state)
    rtol = 2 ** -7 if kv_dtype == "bfloat16" else 0  # one bf16 step, relative to the bottom of its binade
    for a, b, step in zip(pools[True][:2], pools[False][:2], pools[False][2:4]):
        assert ((a - b).abs() <= 1e-5 + rtol * b.abs() + 1.001 * step).all()
    if kv_dtype != "float32":  # the same rounding: the stored keys agree exactly but for rare boundary cases
        native, reference = pools[True][4], pools[False][4]
        written = (native != 0) | (reference != 0)
        assert written.any() and (native == reference)[written].float().mean() > 0.99


def test_out_of_order_pages_fall_back_to_torch(model_dir):
    """Small pages, so a sequence spans several: in order they run natively; out of order (not one run)
    the step takes the torch path, with the same logits."""
    with Engine.open(model_dir, max_seq=64, precision="exact") as engine:
        model = engine.model
        att = model.recipe.attention
        kv = model.state.kv = KVCache(len(model.layers), 64, att.kv_heads, att.head_dim, page_tokens=4)
        ids = PROMPT + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        runs = []
        real = model.native.step_fn
        for shuffle in (False, True):
            out = [model.forward(torch.tensor(PROMPT), 0)[-1]]  # the prompt in pages 0 and 1
            if shuffle:  # move them to pages 5 and 0; the decode steps take 1, 2, 3 after them
                for pool in (kv.k, kv.v):
                    first, second = pool[:, :, 0].clone(), pool[:, :, 1].clone()
                    pool[:, :, 5], pool[:, :, 0] = first, second
                kv.pages = [5, 0]
                kv.free = [p for p in range(16) if p not in kv.pages]
            spy = model.native.step_fn = StepSpy(real, len(model.layers))
            for pos, token in enumerate(ids[len(PROMPT):], start=len(PROMPT)):
                out.append(model.forward(torch.tensor([token]), pos)[-1])
            runs.append((torch.stack(out), spy.calls))
        assert kv.pages == [5, 0, 1, 2, 3]
        assert runs[0][1] > 0 and runs[1][1] == 0
        kv.reset()
        assert kv.contiguous_run() is None  # nothing reserved
        torch.testing.assert_close(runs[0][0], runs[1][0], atol=ATOL, rtol=0)


def test_layer_loop_refuses_a_slot_table_past_the_ring(model_dir):
    """The native step trusts slot_table's slots to hold records: one past the ring is refused, not read."""
    with Engine.open(model_dir, max_seq=64) as engine:
        model = engine.model
        engine.finish_preload()  # nothing left for reap() to account, which would mend the entry
        engine.store.slot_table[0, 0] = engine.store.ring.n_slots
        with pytest.raises(ValueError, match="slot out of range"):
            model.native.step(5, 0)


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 network (the family runner's case): latent attention with a low-rank query."""
    from families import CASES
    root = tmp_path_factory.mktemp("latent")
    return convert(str(CASES["deepseek_v3"].build(root / "ckpt", "per-expert")), root / "q4", "q4",
                   progress=False).out


@pytest.mark.parametrize("kv_dtype, atol", [("float32", ATOL), ("bfloat16", 1e-4), ("int8", 1e-3)])
@pytest.mark.parametrize("threads", [2, 3])
def test_native_latent_attention_matches_the_torch_path(latent_dir, kv_dtype, atol, threads):
    """The latent step (one latent row cached for key and value, kv_b_proj absorbed per head) over every
    cache dtype and an uneven split of the heads over the threads; in the sanitizer set with the rest."""
    with Engine.open(latent_dir, max_seq=64, precision="exact", kv_dtype=kv_dtype, threads=threads) as engine:
        assert engine.model.native is not None
        native, reference = decode(engine, True), decode(engine, False)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(native, reference, atol=atol, rtol=0)
