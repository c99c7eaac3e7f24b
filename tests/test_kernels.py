"""Native expert kernels against torch references, on odd shapes, for every ISA this CPU has."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mosaic_runtime import _native
from mosaic_runtime.experts import expert_ffn, expert_format
from mosaic_runtime.recipe import Activation, ExpertActivation
from mosaic_runtime.vault.format import (HEADER_QUANTS, PROJECTIONS, REQUIRED_SCALE_DTYPE, QuantType, ScaleDtype,
                                         projection_shape, record_layout)
from mosaic_runtime.vault.quant import (dequantize_fp8, dequantize_mxfp4, dequantize_q4, quantize_fp8, quantize_mxfp4,
                                        quantize_q4)
from mosaic_runtime.vault.record import dequantize_record, pack_record, record_biases

K = _native.kernels
ISAS = [isa for isa in (K.SCALAR, K.AVX2, K.AVX512, K.NEON) if K.isa_available(isa)]
# The int8-activation ISAs this CPU runs: their Q4 matvec rounds activations, the rest is their float ISA's.
INT8_ISAS = [isa for isa in (K.AVX2_INT8, K.AVX_VNNI, K.AVX512_VNNI, K.AMX, K.NEON_DOT, K.NEON_I8MM)
             if K.isa_available(isa)]


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


def quantised(quant, rows, cols, seed, scale_dtype=torch.float32):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    if quant is QuantType.Q4_G32:
        codes, scales = quantize_q4(w)
        return codes, scales, ScaleDtype.F16, dequantize_q4(codes, scales, cols)
    if quant is QuantType.MXFP4_G32:
        codes, scales = quantize_mxfp4(w)
        return codes, scales, ScaleDtype.E8M0, dequantize_mxfp4(codes, scales, cols)
    codes, scales = quantize_fp8(w)
    scales = scales.to(scale_dtype)
    return codes, scales, ScaleDtype.BF16 if scale_dtype == torch.bfloat16 else ScaleDtype.F32, \
        dequantize_fp8(codes, scales)


@settings(max_examples=30, deadline=None)
@given(quant=st.sampled_from(HEADER_QUANTS), rows=st.integers(1, 140),
       cols=st.integers(1, 300), n=st.integers(1, 6), isa=st.sampled_from(ISAS), bf16=st.booleans(),
       seed=st.integers(0, 1000))
def test_matvec_matches_dequantised_torch(quant, rows, cols, n, isa, bf16, seed):
    codes, scales, sdt, w = quantised(quant, rows, cols, seed, torch.bfloat16 if bf16 else torch.float32)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(seed + 1))
    y = np.zeros((n, rows), np.float32)
    K.matvec(isa, int(quant), int(sdt), as_bytes(codes), as_bytes(scales), rows, cols, x.numpy(), y)
    ref = (x.double() @ w.double().T)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6  # float32 summation-order slack
    assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all()


def test_fp8_subnormals_and_signs_decode_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(1, -1)  # every E4M3FN value but NaN
    cols = codes.shape[1]
    scales = torch.ones(1, -(-cols // 128))
    x = torch.eye(cols)
    want = codes.view(torch.float8_e4m3fn).float()
    for isa in ISAS:
        y = np.zeros((cols, 1), np.float32)
        K.matvec(isa, int(QuantType.FP8_B128), int(ScaleDtype.F32), as_bytes(codes), as_bytes(scales), 1, cols,
                 x.numpy(), y)
        assert torch.equal(torch.from_numpy(y)[:, 0], want[0]), K.isa_name(isa)


QUANTIZE = {QuantType.Q4_G32: quantize_q4, QuantType.FP8_B128: quantize_fp8, QuantType.MXFP4_G32: quantize_mxfp4}


def random_record(layout, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {p: projection_shape(p, layout.hidden, layout.intermediate) for p in PROJECTIONS}
    planes = {p: QUANTIZE[layout.quant](torch.randn(*shapes[p], generator=g) * 0.2) for p in PROJECTIONS}
    biases = {p: torch.randn(shapes[p][0], generator=g) for p in PROJECTIONS} if layout.bias else None
    return np.frombuffer(bytes(pack_record(layout, planes, biases)), np.uint8)


def run_moe(layout, records, tokens, weights, x, isa, threads, act=ExpertActivation()):
    y = np.zeros_like(x)
    total, max_n = sum(len(t) for t in tokens), max(len(t) for t in tokens)
    fmt = expert_format(layout, act)
    scratch = np.zeros(K.scratch_floats(fmt, total, max_n, threads), np.float32)
    K.moe_experts(isa, threads, fmt, records, tokens, weights, x, y, scratch)
    return y


def scale_dtype_for(quant: QuantType) -> ScaleDtype:
    return REQUIRED_SCALE_DTYPE.get(quant, ScaleDtype.F32)


# gpt-oss's experts: biases on every projection and the clamped SwiGLU; a limit the random activations cross
GPT_OSS = (True, ExpertActivation(Activation.CLAMPED_SWIGLU, 1.702, 0.5))


@pytest.mark.parametrize("quant", HEADER_QUANTS)
@pytest.mark.parametrize("tokens_n", [1, 7])
@pytest.mark.parametrize("bias, act", [(False, ExpertActivation()), GPT_OSS], ids=["silu", "bias-clamped-swiglu"])
def test_moe_experts_match_torch_and_ignore_thread_count(quant, tokens_n, bias, act):
    hidden, inter = 200, 72  # partial Q4 and MXFP4 blocks and FP8 tiles
    layout = record_layout(quant, scale_dtype_for(quant), hidden, inter, bias)
    records = [random_record(layout, s) for s in range(4)]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens_n, hidden, generator=g)
    tokens = [np.arange(tokens_n, dtype=np.int32)[: max(1, tokens_n - i)] for i in range(4)]
    weights = [torch.rand(len(t), generator=g).numpy() for t in tokens]
    ref = torch.zeros(tokens_n, hidden, dtype=torch.float64)
    for rec, tok, w in zip(records, tokens, weights):
        gate, up, down = (m.double() for m in dequantize_record(layout, rec.tobytes()))
        biases = record_biases(layout, rec.tobytes())
        biases = {p: b.double() for p, b in biases.items()} if biases else None
        ref[torch.from_numpy(tok).long()] += torch.from_numpy(w).double()[:, None] * expert_ffn(
            x.double()[torch.from_numpy(tok).long()], gate, up, down, act, biases)
    for isa in ISAS:
        one = run_moe(layout, records, tokens, weights, x.numpy(), isa, 1, act)
        two = run_moe(layout, records, tokens, weights, x.numpy(), isa, 2, act)
        assert np.array_equal(one, two), K.isa_name(isa)  # bit-identical whatever the threads
        assert np.allclose(one, ref.numpy(), rtol=1e-4, atol=1e-4 * ref.abs().max().item()), K.isa_name(isa)


def test_bad_arguments_raise_instead_of_reading_garbage():
    layout = record_layout(QuantType.Q4_G32, ScaleDtype.F16, 64, 32)
    rec = random_record(layout, 0)
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="out of range"):
        run_moe(layout, [rec], [np.array([5], np.int32)], [np.ones(1, np.float32)], x, K.SCALAR, 1)
    with pytest.raises(ValueError, match="shorter"):
        run_moe(layout, [rec[:100]], [np.array([0], np.int32)], [np.ones(1, np.float32)], x, K.SCALAR, 1)


def int8_activation_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the int8-activation kernels compute: x quantised to int8 per 32 exactly as it does, in IEEE float32
    (q = rint(x * (127 / amax)), scale amax / 127; numpy, since torch's scalar division may round
    differently), then exact products."""
    n, cols = x.shape
    nb = -(-cols // 32)
    xp = np.zeros((n, nb * 32), np.float32)
    xp[:, :cols] = x.numpy()
    blocks = xp.reshape(n, nb, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv).astype(np.float64)
    sx = (amax / np.float32(127)).astype(np.float64)
    return torch.from_numpy((q * sx).reshape(n, nb * 32)[:, :cols]) @ w.double().T


@pytest.mark.skipif(not INT8_ISAS, reason="no int8-activation ISA on this CPU")
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 140), cols=st.integers(1, 600), n=st.integers(1, 5), seed=st.integers(0, 1000),
       isa=st.sampled_from(INT8_ISAS or [None]), quant=st.sampled_from([QuantType.Q4_G32, QuantType.MXFP4_G32]))
def test_int8_activation_kernels_match_their_reference(rows, cols, n, seed, isa, quant):
    codes, scales, sdt, w = quantised(quant, rows, cols, seed)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(seed + 1))
    y = np.zeros((n, rows), np.float32)
    K.matvec(isa, int(quant), int(sdt), as_bytes(codes), as_bytes(scales), rows, cols, x.numpy(), y)
    ref = int8_activation_reference(x, w)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all()
    # and within int8 rounding of the float result
    exact = x.double() @ w.double().T
    assert ((torch.from_numpy(y).double() - exact).abs() <= int8_rounding_bound(x, w)).all()


@pytest.mark.skipif(not K.isa_available(K.AVX_VNNI), reason="no AVX-VNNI on this CPU")
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 600), n=st.integers(1, 20), seed=st.integers(0, 1000),
       quant=st.sampled_from([QuantType.Q4_G32, QuantType.MXFP4_G32]))
def test_avx_vnni_agrees_with_the_avx2_int8_loop_bit_for_bit(rows, cols, n, seed, quant):
    # One loop, two instruction sets for its integer dot products, both exact: any difference is a bug.
    codes, scales, sdt, _ = quantised(quant, rows, cols, seed)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(seed + 1)).numpy()
    ys = []
    for isa in (K.AVX2_INT8, K.AVX_VNNI):
        ys.append(np.zeros((n, rows), np.float32))
        K.matvec(isa, int(quant), int(sdt), as_bytes(codes), as_bytes(scales), rows, cols, x, ys[-1])
    assert np.array_equal(ys[0], ys[1])


@pytest.mark.skipif(not INT8_ISAS, reason="no int8-activation ISA on this CPU")
@pytest.mark.parametrize("quant", [QuantType.Q4_G32, QuantType.MXFP4_G32])
@pytest.mark.parametrize("rows,cols,n", [(17, 96, 16), (33, 257, 19), (130, 600, 35), (5, 2048, 70), (150, 4100, 21)])
def test_int8_prefills_match_their_reference(rows, cols, n, quant):
    # Prefill-sized calls: AMX takes them in 16 x 16 tiles (whole and partial), the other loops in token tiles
    # over panels of rows (150 rows of 4100 columns are five, the last one short).
    codes, scales, sdt, w = quantised(quant, rows, cols, rows + cols + n)
    x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
    ref = int8_activation_reference(x, w)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    for isa in INT8_ISAS:
        y = np.zeros((n, rows), np.float32)
        K.matvec(isa, int(quant), int(sdt), as_bytes(codes), as_bytes(scales), rows, cols, x.numpy(), y)
        assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all(), K.isa_name(isa)


def int8_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far int8 activations may take X @ W.T from the float product: at most half a step (amax/254
    of its block of 32) per activation, plus float slack."""
    n, cols = x.shape
    step = torch.zeros(n, -(-cols // 32) * 32, dtype=torch.float64)
    step[:, :cols] = x.double()
    half = (step.view(n, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(n, -1)[:, :cols]
    return half @ w.double().abs().T * 1.0001 + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 300), n=st.integers(1, 6), seed=st.integers(0, 1000),
       isa=st.sampled_from(ISAS))
@example(rows=9, cols=4100, n=37, seed=1, isa=ISAS[-1])  # a prompt in several L2-sized token blocks
@example(rows=7, cols=45, n=5, seed=2, isa=ISAS[-1])  # row groups of four and three, a column tail
@example(rows=6, cols=40, n=3, seed=3, isa=ISAS[-1])  # four and two
def test_linear_bf16_matches_float_reference(rows, cols, n, seed, isa):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(n, cols, generator=g)
    y = np.zeros((n, rows), np.float32)
    K.linear_bf16(isa, 2, w.view(torch.uint16).numpy(), x.numpy(), y)
    ref = x.double() @ w.double().T  # bf16 widens exactly: the reference is the float product
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 300), n=st.integers(1, 6), seed=st.integers(0, 1000),
       isa=st.sampled_from(ISAS), mode=st.sampled_from(["int8", "fp8"]))
@example(rows=9, cols=4100, n=37, seed=1, isa=ISAS[-1], mode="int8")  # several L2-sized token blocks
def test_linear_quant_matches_its_dequantised_matrix(rows, cols, n, seed, isa, mode):
    from mosaic_runtime.backbone import quantize_matrix
    g = torch.Generator().manual_seed(seed)
    q = quantize_matrix(torch.randn(rows, cols, generator=g).bfloat16(), mode)
    x = torch.randn(n, cols, generator=g)
    y = np.zeros((n, rows), np.float32)
    K.linear_quant(isa, 2, q.codes.numpy(), q.scales.numpy(), q.fp8, x.numpy(), y)
    w = q.dequantize().double()
    ref = x.double() @ w.T  # codes widen exactly: the reference is the float product
    bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), cols=st.integers(1, 300), n=st.integers(1, 6), seed=st.integers(0, 1000),
       isa=st.sampled_from(ISAS + INT8_ISAS))
def test_linear_q4_matches_its_dequantised_matrix(rows, cols, n, seed, isa):
    """The Q4 backbone GEMV (the expert kernels' matvec over row blocks) against its dequantised matrix:
    float ISAs to float rounding, int8-activation ones within their activations' error."""
    from mosaic_runtime.backbone import quantize_matrix
    g = torch.Generator().manual_seed(seed)
    q = quantize_matrix(torch.randn(rows, cols, generator=g), "q4")
    x = torch.randn(n, cols, generator=g)
    y = np.zeros((n, rows), np.float32)
    K.linear_q4(isa, 2, q.codes.numpy(), q.scales.view(torch.uint16).numpy(), x.numpy(), y)
    w = q.dequantize().double()
    ref = x.double() @ w.T
    bound = int8_rounding_bound(x, w) if isa in INT8_ISAS else 1e-5 * (x.double().abs() @ w.abs().T) + 1e-6
    assert ((torch.from_numpy(y).double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("mode, worst", [("int8", 0.02), ("fp8", 0.07), ("q4", 0.15)])
def test_backbone_quantisation_error_is_bounded(mode, worst):
    from mosaic_runtime.backbone import quantize_matrix
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0))
    q = quantize_matrix(w, mode).dequantize()
    rel = ((q - w).norm() / w.norm()).item()
    assert rel < worst  # int8 per row: ~1 %; E4M3 (3 mantissa bits): ~2-4 %; Q4 per 32: ~10 %


@pytest.mark.parametrize("quant", [QuantType.Q4_G32, QuantType.FP8_B128])
@pytest.mark.parametrize("hidden", [200, 300])
def test_decode_shaped_calls_take_the_staged_driver_bit_for_bit(quant, hidden):
    """One row a task (a decode step): each expert's gate, up and two halves of its down projection are
    separate work items (moe_decode_staged; the halves split on an FP8 128-row block). The sums must be
    those of the whole-expert driver, which a two-row task with weight zero forces."""
    inter = 72
    layout = record_layout(quant, ScaleDtype.F16 if quant is QuantType.Q4_G32 else ScaleDtype.F32, hidden, inter)
    records = [random_record(layout, s) for s in range(5)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, hidden, generator=g).numpy()
    tokens = [np.array([i % 2], np.int32) for i in range(5)]
    weights = [torch.rand(1, generator=g).numpy() for _ in range(5)]
    for isa in ISAS + INT8_ISAS:
        for threads in (1, 2, 3):
            staged = run_moe(layout, records, tokens, weights, x, isa, threads)
            whole = run_moe(layout, records + [records[0]], tokens + [np.array([0, 1], np.int32)],
                            weights + [np.zeros(2, np.float32)], x, isa, threads)
            assert np.array_equal(staged, whole), (K.isa_name(isa), threads)


def _isa_report(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOSAIC_ISA"}
    if value is not None:
        env["MOSAIC_ISA"] = value
    code = "from mosaic_runtime import _native as n; k = n.kernels; print(k.best_isa(), k.int8_isa())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_mosaic_isa_caps_the_kernels_and_reports_a_bad_value():
    hardware = _isa_report(None).stdout.split()
    assert _isa_report("scalar").stdout.split() == [str(K.SCALAR), "None"]
    if K.isa_available(K.AVX2):  # AVX2 takes AVX-VNNI where the CPU has it; avx2-int8 forces the plain loop
        vnni = K.isa_available(K.AVX_VNNI)
        assert _isa_report("avx2").stdout.split() == [str(K.AVX2), str(K.AVX_VNNI if vnni else K.AVX2_INT8)]
        assert _isa_report("avx2-int8").stdout.split() == [str(K.AVX2), str(K.AVX2_INT8)]
        if vnni:
            assert _isa_report("avx-vnni").stdout.split() == [str(K.AVX2), str(K.AVX_VNNI)]
    bad = _isa_report("avx9000")
    assert bad.stdout.split() == hardware
    names = ("scalar, neon, neon-i8mm, neon-dot" if K.isa_available(K.NEON)  # this build's architecture
             else "scalar, avx2, avx512, amx, avx512-vnni, avx-vnni, avx2-int8")
    assert f"MOSAIC_ISA=avx9000 is not one of {names}; ignored" in bad.stderr


@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (5, 2, 129), (513, 64)])
def test_rms_norm_on_the_cpu_matches_float64_whatever_the_threads(shape):
    # The prompt's norms run the decode step's native norm row by row (models/base.rms_norm): each row as
    # the float64 formula gives it, and the same bits on any thread count.
    from mosaic_runtime.models.base import rms_norm
    from mosaic_runtime.ops import using_threads
    g = torch.Generator().manual_seed(len(shape))
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    ref = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    outs = []
    for threads in (1, 2, 3):
        with using_threads(threads):
            outs.append(rms_norm(x, w, 1e-6))
    assert outs[0].shape == x.shape and (outs[0].double() - ref).abs().max() <= 1e-6 * ref.abs().max()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
