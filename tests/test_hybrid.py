"""The hybrids' own paths: decode after a long (chunked) prefill, reduced KV caches, the three forms of the
gated delta rule, a block-FP8 source. Their logits against transformers are tests/test_families.py's.

Tolerance: max |logit difference| <= 1e-3 on logits of magnitude ~10 (measured: 5e-5 to 7e-4). Both
sides run a chunked delta rule over 70+ tokens in float32, with different formulations (transformers'
UT transform against our triangular solve), so their rounding differs more than in plain attention.
"""

import numpy as np
import pytest
import torch

from builders import tiny_hybrid
from mosaic_runtime.engine import Engine
from mosaic_runtime import _native
from mosaic_runtime.models.delta_rule import (chunk_gated_delta_rule, native_gated_delta_rule,
                                              recurrent_gated_delta_rule)
from mosaic_shatter.convert import convert
from reference import reference_model

ATOL = 1e-3
PROMPT = [(37 * i + 11) % 320 for i in range(70)]  # 70 tokens: more than one 64-token chunk
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def vaults(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hybrid")
    ckpt = tiny_hybrid("qwen3_next", root / "qwen3_next", seed=10)
    return {("qwen3_next", "q4"): (ckpt, convert(str(ckpt), root / "qwen3_next-q4", "q4", progress=False).out)}


def test_decode_after_a_long_prefill_equals_a_full_forward(vaults):
    engine = Engine.open(vaults[("qwen3_next", "q4")][1], max_seq=256, precision="exact")
    ids = (PROMPT * 3)[:200]
    full = engine.logits(ids)
    engine.logits(ids[:150])  # prefill (chunked), then token by token (recurrent)
    steps = [engine.model.forward(torch.tensor([t]), engine.model.state.length)[-1] for t in ids[150:]]
    assert (torch.stack(steps) - full[150:]).abs().max() <= ATOL


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_reduced_kv_cache_keeps_the_greedy_tokens(vaults, kv_dtype):
    """The hybrid's full-attention layers over a bf16 or int8 cache (decode through the native kernels):
    the same greedy tokens as the float32 cache, logits within the rounding."""
    out = vaults[("qwen3_next", "q4")][1]
    runs = {}
    for dtype in ("float32", kv_dtype):
        engine = Engine.open(out, max_seq=128, kv_dtype=dtype, precision="exact")
        tokens = list(engine.generate_ids(PROMPT, max_new_tokens=DECODE_STEPS))
        runs[dtype] = tokens, engine.logits(PROMPT + tokens)
    assert runs[kv_dtype][0] == runs["float32"][0]
    torch.testing.assert_close(runs[kv_dtype][1], runs["float32"][1], atol=4e-2, rtol=0)


@pytest.mark.parametrize("t", [1, 7, 64, 65, 150])
def test_chunked_delta_rule_equals_the_recurrence(t):
    g = torch.Generator().manual_seed(t)
    h, dk, dv = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=g), dim=-1)
    v, gate = torch.randn(t, h, dv, generator=g), -torch.rand(t, h, generator=g) * 3
    beta, s0 = torch.rand(t, h, generator=g), torch.randn(h, dk, dv, generator=g)
    s1, s2 = s0.clone(), s0.clone()
    o1 = recurrent_gated_delta_rule(q, k, v, gate, beta, s1)
    o2 = chunk_gated_delta_rule(q, k, v, gate, beta, s2)
    assert (o1 - o2).abs().max() <= 1e-5 and (s1 - s2).abs().max() <= 1e-5


K = _native.kernels
FLOAT_ISAS = [isa for isa in (K.SCALAR, K.AVX2, K.AVX512, K.NEON) if K.isa_available(isa)]


@pytest.mark.parametrize("isa", FLOAT_ISAS, ids=K.isa_name)
@pytest.mark.parametrize("t, hk, hv, dk, dv", [(1, 1, 1, 16, 8), (7, 2, 6, 17, 45), (65, 3, 3, 33, 64),
                                               (150, 2, 4, 128, 97)])
def test_native_delta_rule_equals_the_recurrence(isa, t, hk, hv, dk, dv):
    """The native prefill form (key heads read in place, the state's columns in blocks of 32 with a ragged
    last one, tokens in runs of 64, v a strided view) against the torch recurrence on the repeated heads;
    the thread count changes no bit (each head is one thread's)."""
    g = torch.Generator().manual_seed(t + dv)
    q = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, hk, dk, generator=g), dim=-1)
    v = torch.randn(t, hv * dv + 5, generator=g)[:, 5:].view(t, hv, dv)  # heads contiguous, tokens strided
    gate, beta = -torch.rand(t, hv, generator=g) * 3, torch.rand(t, hv, generator=g)
    s0 = torch.randn(hv, dk, dv, generator=g)
    ref_state = s0.clone()
    ref = recurrent_gated_delta_rule(q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1), v, gate,
                                     beta, ref_state)
    runs = []
    for threads in (1, 2):
        state, out = s0.clone(), np.empty((t, hv, dv), np.float32)
        K.gated_delta_rule(isa, threads, q.numpy(), k.numpy(), v.numpy(), gate.numpy(), beta.numpy(), state.numpy(),
                           out)
        runs.append((torch.from_numpy(out), state))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert (runs[0][0] - ref).abs().max() <= 1e-5 and (runs[0][1] - ref_state).abs().max() <= 1e-5
    with_threads = native_gated_delta_rule(q, k, v, gate, beta, s0.clone())  # the engine's call
    assert (with_threads - ref).abs().max() <= 1e-5


def test_native_delta_rule_rejects_shapes_that_disagree():
    q = np.zeros((4, 2, 8), np.float32)
    v, gb = np.zeros((4, 3, 8), np.float32), np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="gated_delta_rule: shapes"):  # 3 value heads cannot share 2 key heads
        K.gated_delta_rule(K.SCALAR, 1, q, q, v, gb, gb, np.zeros((3, 8, 8), np.float32), np.zeros_like(v))


@pytest.mark.parametrize("quant", ["q4", "fp8"])
def test_block_fp8_source_with_f32_scales(tmp_path, quant):
    """Qwen3-Next-FP8's layout: E4M3 linears (in_proj_qkvz, out_proj, attention, experts, shared expert)
    with F32 128x128 scales; in_proj_ba, conv, norms, router and gates unquantised."""
    from builders import to_block_fp8
    bf16 = tiny_hybrid("qwen3_next", tmp_path / "bf16", seed=8)
    src = to_block_fp8(bf16, tmp_path / "fp8-src", scale_dtype=torch.float32)
    out = convert(str(src), tmp_path / quant, quant, progress=False).out
    engine = Engine.open(out, max_seq=128, precision="exact")
    if quant == "fp8":
        assert engine.vault.lineage["quant"]["passthrough"] and engine.vault.lineage["quant"]["scale_dtype"] == "f32"
    logits = engine.logits(PROMPT)
    ref = reference_model(bf16, engine)  # transformers' model, holding exactly the vault's weights
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    assert (logits - want).abs().max() <= ATOL
