"""Quantise/dequantise references: error bounds on odd shapes, against independent scalar references."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mosaic_runtime.vault.format import FP8_BLOCK, Q4_BLOCK
from mosaic_runtime.vault.quant import dequantize_fp8, dequantize_q4, quantize_fp8, quantize_q4

shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))


def weights(rows, cols, seed, heavy):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    if heavy:  # a few large outliers, as real checkpoints have
        w = w * torch.where(torch.rand(rows, cols, generator=g) < 0.01, 30.0, 1.0)
    return w


def q4_0_block_error(w: np.ndarray) -> np.ndarray:
    """llama.cpp Q4_0, written out element by element: squared error per 32-weight block."""
    rows, cols = w.shape
    nb = -(-cols // Q4_BLOCK)
    err = np.zeros((rows, nb))
    for r in range(rows):
        for b in range(nb):
            blk = np.zeros(Q4_BLOCK, np.float32)
            part = w[r, b * Q4_BLOCK:(b + 1) * Q4_BLOCK]
            blk[:len(part)] = part
            m = blk[np.argmax(np.abs(blk))]
            d = np.float32(np.float16(m / -8.0))
            inv = 1.0 / d if d else 0.0
            q = np.clip(np.floor(blk * inv + 8.5), 0, 15)
            err[r, b] = np.sum(((q - 8) * d - blk) ** 2)
    return err


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2**16), st.booleans())
def test_q4_never_worse_than_q4_0_on_any_block(shape, seed, heavy):
    w = weights(*shape, seed, heavy)
    codes, scales = quantize_q4(w)
    rows, cols = shape
    nb = -(-cols // Q4_BLOCK)
    assert codes.shape == (rows, nb * 16) and codes.dtype == torch.uint8
    assert scales.shape == (rows, nb) and scales.dtype == torch.float16
    deq = dequantize_q4(codes, scales, cols)
    assert deq.shape == w.shape
    padded = torch.zeros(rows, nb * Q4_BLOCK)
    padded[:, :cols] = deq - w
    ours = (padded.view(rows, nb, Q4_BLOCK).double() ** 2).sum(-1).numpy()
    ref = q4_0_block_error(w.numpy())
    # Q4_0 rounds half up, the encoder rounds half to even: allow float noise, never a real loss.
    assert np.all(ours <= ref * (1 + 1e-5) + 1e-12)


def test_q4_partial_block_is_padded_with_zero_codes():
    w = torch.randn(3, 37)
    codes, scales = quantize_q4(w)
    tail = codes.view(3, 2, 16)[:, 1]  # block 1 holds elements 32..63; 37..63 are padding
    low, high = tail & 0x0F, tail >> 4
    assert torch.all(low[:, 5:] == 8) and torch.all(high == 8)


def test_q4_nibble_order_matches_the_spec():
    # Element 32b+j is the low nibble of byte j, element 32b+j+16 the high nibble (vault_format.md §4.1).
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 16] = -8.0, 7.0  # with d = 1: codes 0 and 15
    codes, scales = quantize_q4(w)
    assert scales[0, 0].item() == 1.0
    assert codes[0, 0].item() == (0 | 15 << 4)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 2**16), st.booleans())
def test_fp8_error_bound(shape, seed, heavy):
    w = weights(*shape, seed, heavy)
    codes, scales = quantize_fp8(w)
    rows, cols = shape
    assert codes.shape == (rows, cols) and scales.shape == (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    deq = dequantize_fp8(codes, scales)
    s = scales.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    # E4M3: 3 mantissa bits, so half an ulp is 2^-4 relative for normals; subnormal steps are s * 2^-9.
    bound = w.abs() * 2.0 ** -4 + s * 2.0 ** -10
    assert torch.all((deq - w).abs() <= bound * 1.0001)


def test_fp8_block_extreme_is_exact():
    w = torch.randn(130, 260)
    codes, scales = quantize_fp8(w)
    deq = dequantize_fp8(codes, scales)
    i = w[:128, :128].abs().argmax()
    r, c = divmod(i.item(), 128)
    assert torch.isclose(deq[r, c], w[r, c], rtol=1e-6)


def test_quantisers_are_deterministic():
    w = torch.randn(64, 96)
    assert all(torch.equal(a, b) for a, b in zip(quantize_q4(w), quantize_q4(w.clone())))
    assert all(torch.equal(a, b) for a, b in zip(quantize_fp8(w), quantize_fp8(w.clone())))


def test_non_finite_weights_are_refused():
    w = torch.ones(4, 32)
    w[1, 3] = float("nan")
    for quantize in (quantize_q4, quantize_fp8):
        try:
            quantize(w)
        except ValueError as e:
            assert "nan" in str(e)
        else:
            raise AssertionError("nan accepted")


ENCODER_SHAPES = [(1, 1, 1), (3, 31, 2), (17, 33, 3), (64, 96, 2), (257, 2048, 2), (5, 7168, 1)]
ENCODER_KINDS = ["gaussian", "heavy", "mixed-scale", "zeros-and-ties", "signed-zeros"]


def encoder_weights(rows: int, cols: int, kind: str) -> torch.Tensor:
    """Odd shapes, partial blocks, heavy tails, blocks mixing magnitudes 2^20 apart, all-zero blocks, exact
    ties (weights on the half-steps of their scale), values near f16's subnormal range, and blocks of zeros of
    both signs (the sign of an all-zero block's scale is whichever zero its extreme is)."""
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    w = torch.randn(rows, cols, generator=g) * 0.02
    if kind == "heavy":
        w = torch.distributions.StudentT(2.0).sample((rows, cols)) * 0.01
    elif kind == "mixed-scale":
        w = w * torch.where(torch.rand(rows, cols, generator=g) < 0.3, 1e-6, 1.0) + \
            (torch.rand(rows, cols, generator=g) < 0.01) * 1e-5
    elif kind == "zeros-and-ties":
        w = torch.randint(-16, 16, (rows, cols), generator=g).float() * 2 ** -20  # many exact halves and ties
        w[:, : cols // 3] = 0.0
    elif kind == "signed-zeros":
        zeros = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -0.0, 0.0)
        w = torch.where(torch.rand(rows, 1, generator=g) < 0.7, zeros, w)  # most rows zeros of both signs
    return w


@pytest.mark.parametrize("rows, cols, threads", ENCODER_SHAPES)
@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_native_q4_encoder_writes_the_reference_bytes(rows, cols, threads, kind):
    """The native encoder (native/src/encode_q4*.cpp, this CPU's best path) against the torch reference,
    byte for byte."""
    from mosaic_runtime.vault import quant
    if quant._kernels is None:
        pytest.skip("the native extension is not built")
    w = encoder_weights(rows, cols, kind)
    want = quant.quantize_q4_reference(w)
    got = quant.quantize_q4(w, threads=threads)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


ENCODE_UNDER_ISA = """
import sys, torch
from mosaic_runtime.vault.quant import quantize_q4
weights = torch.load(sys.argv[1])
torch.save([quantize_q4(w, threads=2) for w in weights], sys.argv[2])
"""


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_each_isa_path_of_the_q4_encoder_writes_the_reference_bytes(tmp_path, isa):
    """The encoder's paths below this CPU's best (the test above holds that one), forced by MOSAIC_ISA in a
    fresh process (the ISA is chosen once per process), on the same weights, as float32 and as bf16: the
    reference's bytes."""
    from mosaic_runtime.vault import quant
    if quant._kernels is None:
        pytest.skip("the native extension is not built")
    from mosaic_runtime import _native
    if not _native.kernels.isa_available(getattr(_native.kernels, isa.upper())):
        pytest.skip(f"this CPU has no {isa}")
    weights = [encoder_weights(rows, cols, kind) for rows, cols, _ in ENCODER_SHAPES for kind in ENCODER_KINDS]
    weights += [w.to(torch.bfloat16) for w in weights[-8:]]
    torch.save(weights, tmp_path / "w.pt")
    env = dict(os.environ, MOSAIC_ISA=isa)
    subprocess.run([sys.executable, "-c", ENCODE_UNDER_ISA, str(tmp_path / "w.pt"), str(tmp_path / "q.pt")],
                   env=env, check=True)
    for w, (codes, scales) in zip(weights, torch.load(tmp_path / "q.pt")):
        want = quant.quantize_q4_reference(w.float())
        assert torch.equal(codes, want[0]) and torch.equal(scales.view(torch.int16), want[1].view(torch.int16))


@pytest.mark.parametrize("rows, cols, threads", ENCODER_SHAPES + [(129, 257, 2), (300, 1000, 2)])
@pytest.mark.parametrize("kind", ENCODER_KINDS)
def test_native_fp8_encoder_writes_the_reference_bytes(rows, cols, threads, kind):
    """The native FP8 encoder (native/src/encode_fp8.cpp) against the torch reference, byte for byte, on
    float32 and on bf16 weights: partial tiles, heavy tails, mixed magnitudes, all-zero tiles."""
    from mosaic_runtime.vault import quant
    if quant._kernels is None:
        pytest.skip("the native extension is not built")
    w = encoder_weights(rows, cols, kind)
    for stored, exact in ((w, w), (w.to(torch.bfloat16), w.to(torch.bfloat16).float())):
        got, want = quant.quantize_fp8(stored, threads=threads), quant.quantize_fp8_reference(exact)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_native_fp8_rounding_is_torchs_on_every_kind_of_value():
    """Tiles whose amax is 448 (scale 1), so the codes are the rounding itself: random float32 bit patterns
    across [-448, 448] (normal, subnormal and zero in E4M3), every E4M3 value, and every midpoint between
    neighbours (ties go to the even code)."""
    from mosaic_runtime.vault import quant
    if quant._kernels is None:
        pytest.skip("the native extension is not built")
    bits = torch.randint(0, 2 ** 31, (400_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x[torch.isfinite(x) & (x.abs() <= 448)], grid, mids, -mids])
    tiles = x[: len(x) // 127 * 127].view(-1, 127)
    tiles = torch.cat([torch.full((len(tiles), 1), 448.0), tiles], 1)  # amax 448 in every tile
    got, want = quant.quantize_fp8(tiles), quant.quantize_fp8_reference(tiles)
    assert (got[1] == 1).all() and torch.equal(got[0], want[0])


@pytest.mark.parametrize("cols", [64, 600])  # blocks one at a time; sixteen (or eight) at once where a row has them
def test_native_q4_encoder_refuses_what_the_reference_refuses(cols):
    from mosaic_runtime.vault import quant
    w = torch.ones(4, cols)
    w[2, cols // 2] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_q4(w)
    w[2, cols // 2] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quant.quantize_q4(w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="f16 range"):
        quant.quantize_q4(torch.full((2, cols), 1e6))
    with pytest.raises(ValueError, match="f16 range"):
        quant.quantize_q4_reference(torch.full((2, 32), 1e6))


def test_native_q4_encoder_takes_bf16_as_its_float32_values():
    """bf16 weights go to the encoder as their bit patterns (no float32 copy): the same bytes as the float32
    values they widen to, through the native encoder and the reference."""
    from mosaic_runtime.vault import quant
    if quant._kernels is None:
        pytest.skip("the native extension is not built")
    w = (torch.randn(37, 1000, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    want = quant.quantize_q4_reference(w.float())
    for got in (quant.quantize_q4(w), quant.quantize_q4(w.float())):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.int16), want[1].view(torch.int16))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_row_chunks_quantise_as_the_whole_matrix(monkeypatch, mode):
    """quantize_matrix works through row chunks; each row's scale and codes are what one pass over the whole
    matrix gives (the per-row formula)."""
    from mosaic_runtime import backbone
    w = (torch.randn(300, 96, generator=torch.Generator().manual_seed(4)) * 0.02).to(torch.bfloat16)
    monkeypatch.setattr(backbone, "ROW_CHUNK_BYTES", 7 * 96 * 4)  # 7 rows a chunk: 43 chunks, the last short
    got = backbone.quantize_matrix(w, mode)
    x = w.float()
    amax = x.abs().amax(dim=1).clamp_min(1e-30)
    if mode == "int8":
        scales = amax / 127.0
        codes = torch.round(x / scales[:, None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        scales = amax / backbone.FP8_MAX
        codes = (x / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got.codes, codes) and torch.equal(got.scales, scales) and got.fp8 == (mode == "fp8")
