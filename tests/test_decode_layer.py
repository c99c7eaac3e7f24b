"""The native decode step (native/src/decode_layer.cpp: a Qwen3-MoE layer's attention block and router in
one call) against the torch path it replaces, for every backbone precision, dense and MoE layers, and a
cache whose pages are out of order (which falls back to the torch path)."""

import pytest
import torch

from builders import random_qwen3_moe
from mosaic_runtime.engine import Engine
from mosaic_runtime.kv_cache import KVCache
from mosaic_shatter.convert import convert

PROMPT = [5, 17, 101, 64, 3, 250, 77, 9]
STEPS = 10
ATOL = 2e-5  # float32 in another order (norms, softmax, attention); logits are O(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layer")
    ckpt = random_qwen3_moe(root / "ckpt", seed=11, eos_token_id=None, num_experts=8, num_experts_per_tok=3,
                            num_hidden_layers=3, mlp_only_layers=[1])
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def decode(engine, native: bool):
    engine.model.use_native_decode = native
    logits = [engine.logits(PROMPT)[-1]]
    for _ in range(STEPS):
        logits.append(engine.model.forward(torch.tensor([int(logits[-1].argmax())]), engine.model.kv.length)[-1])
    return torch.stack(logits)


@pytest.mark.parametrize("backbone", ["bf16", "int8", "fp8", "q4"])
def test_native_decode_step_matches_the_torch_path(model_dir, backbone):
    with Engine.open(model_dir, max_seq=64, backbone=backbone) as engine:
        assert engine.model.native_layers is not None
        native, reference = decode(engine, True), decode(engine, False)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(native, reference, atol=ATOL, rtol=0)


def test_native_step_is_used_and_writes_the_same_cache(model_dir):
    pools = {}
    for native in (True, False):
        with Engine.open(model_dir, max_seq=64) as engine:
            calls = []
            layers = engine.model.native_layers
            engine.model.native_layers = [lambda *a, n=n: (calls.append(1), n(*a))[1] for n in layers]
            decode(engine, native)
            assert len(calls) == (STEPS * len(layers) if native else 0)
            pools[native] = engine.model.kv.k.clone(), engine.model.kv.v.clone()
    for a, b in zip(pools[True], pools[False]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_out_of_order_pages_fall_back_to_torch(model_dir):
    """Small pages, so a sequence spans several: in order they run natively; out of order (not one run)
    the step takes the torch path, with the same logits."""
    with Engine.open(model_dir, max_seq=64) as engine:
        model = engine.model
        model.kv = KVCache(len(model.layers), 64, model.kv_heads, model.head_dim, page_tokens=4)
        ids = PROMPT + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        runs = []
        for pages in (None, [5, 0, 3, 1, 2]):
            model.kv.reset()
            if pages:
                model.kv.pages = list(pages)
                model.kv.free = [p for p in range(16) if p not in pages]
            calls = []
            layers = model.native_layers
            model.native_layers = [lambda *a, n=n: (calls.append(1), n(*a))[1] for n in layers]
            out = [model.forward(torch.tensor(PROMPT), 0)[-1]]
            for pos, token in enumerate(ids[len(PROMPT):], start=len(PROMPT)):
                out.append(model.forward(torch.tensor([token]), pos)[-1])
            model.native_layers = layers
            runs.append((torch.stack(out), len(calls)))
        assert runs[0][1] > 0 and runs[1][1] == 0
        model.kv.reset()
        assert model.kv.contiguous_run() is None  # nothing reserved
        torch.testing.assert_close(runs[0][0], runs[1][0], atol=ATOL, rtol=0)


def test_bf16_kv_cache_keeps_the_torch_path(model_dir):
    with Engine.open(model_dir, max_seq=64, kv_dtype="bfloat16") as engine:
        assert engine.model.native_layers is None
