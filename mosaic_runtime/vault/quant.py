"""Quantise and dequantise references for every vault block type, side by side (vault_format.md §4).

All functions take and return torch tensors on the CPU. Matrices are [rows, cols] as nn.Linear stores
them; blocks run along cols (the input dimension) for Q4 and over 128 x 128 tiles for FP8.
"""

from __future__ import annotations

import os

import torch

from .format import (E2M1_VALUES, E8M0_BIAS, E8M0_NAN, FP8_BLOCK, FP8_E4M3_MAX, LOW_BIT_TYPES, MXFP4_BLOCK,
                     MXFP4_BLOCK_BYTES, Q4_BLOCK, Q4_BLOCK_BYTES, Q4_ZERO, QuantType, ScaleDtype)

SCALE_TORCH_DTYPES = {ScaleDtype.F16: torch.float16, ScaleDtype.BF16: torch.bfloat16, ScaleDtype.F32: torch.float32,
                      ScaleDtype.E8M0: torch.uint8}


def scale_dtype_of(dtype: torch.dtype) -> ScaleDtype:
    for code, torch_dtype in SCALE_TORCH_DTYPES.items():
        if torch_dtype == dtype and code is not ScaleDtype.E8M0:
            return code
    raise ValueError(f"no vault scale dtype for {dtype}")


# --- Q4_G32 -------------------------------------------------------------------------------------
def _block_codes(blocks: torch.Tensor, d: torch.Tensor, zero: int = Q4_ZERO, top: int = Q4_ZERO - 1):
    """Signed codes in [-zero, top] (Q4: [-8, 7]) of blocks [R, nb, 32] under f16 scales d [R, nb, 1].

    Returns (q, err, qw, qq): err is the block's squared error less sum(w^2) (the same for every d, so
    it drops out of comparisons), from sum(q w) and sum(q q), in float64 so near-ties compare exactly.
    """
    d32 = d.float()
    inv = torch.where(d32 != 0, 1.0 / d32, torch.zeros_like(d32))
    q = torch.mul(blocks, inv).round_().clamp_(-zero, top)
    # In float64 the sums are exact whatever their order (a code times a float32 weight fits in 28 bits,
    # and weights with a non-zero code are within 2^8 of the block's largest), so the native encoder,
    # summing in its own order, reaches the same bits.
    q64 = q.double()
    qw = (q64 * blocks.double()).sum(-1, keepdim=True)
    qq = (q64 * q64).sum(-1, keepdim=True)
    d64 = d32.double()
    return q, d64 * d64 * qq - 2 * d64 * qw, qw, qq


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    """float32 [R, nb, 32] of w [R, C], zero-padded past C (no copy of a float32 w of whole blocks)."""
    rows, cols = w.shape
    nb = -(-cols // Q4_BLOCK)
    if cols == nb * Q4_BLOCK:
        return w.float().reshape(rows, nb, Q4_BLOCK)
    blocks = torch.zeros(rows, nb * Q4_BLOCK, dtype=torch.float32)
    blocks[:, :cols] = w.float()
    return blocks.view(rows, nb, Q4_BLOCK)


try:  # the format side needs no compiled extension (a convert runs without one), but uses it when built
    from .._native import kernels as _kernels
except ImportError:
    _kernels = None
_ENCODE_ERRORS = {1: "weights contain inf or nan", 2: "weights exceed the f16 range of Q4 scales"}


def quantize_q4(w: torch.Tensor, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_G32 (quantize_q4_reference's bytes) through the native encoder where the extension is built, on
    `threads` threads (default: every core); else the reference itself."""
    if _kernels is None:
        return quantize_q4_reference(w)
    rows, cols = w.shape
    nb = -(-cols // Q4_BLOCK)
    codes = torch.empty(rows, nb * Q4_BLOCK_BYTES, dtype=torch.uint8)
    scales = torch.empty(rows, nb, dtype=torch.float16)
    # bf16 goes as its bit patterns, widened block by block natively: no float32 copy of a large matrix
    src = w.contiguous().view(torch.uint16) if w.dtype == torch.bfloat16 else w.float().contiguous()
    status = _kernels.encode_q4(threads or os.cpu_count() or 1, src.numpy(), codes.numpy(),
                                scales.view(torch.uint16).numpy())
    if status:
        raise ValueError(_ENCODE_ERRORS[status])
    return codes, scales


def quantize_q4_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_G32: w ~= d * (q - 8), one f16 d per 32 weights of a row.

    The encoder starts from llama.cpp's Q4_0 scale (the weight of largest magnitude maps to -8), refits
    d by least squares for those codes, and keeps whichever of the two has the smaller block error.
    Columns past the last whole block are padded with zeros (code 8).

    Returns:
        codes: uint8 [R, ceil(C/32) * 16]; byte j of block b holds element 32b+j (low nibble) and
            32b+j+16 (high nibble).
        scales: float16 [R, ceil(C/32)].
    """
    rows, cols = w.shape
    nb = -(-cols // Q4_BLOCK)
    blocks = _padded_blocks(w)  # [R, nb, 32]
    hi, lo = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)  # [R, nb, 1]
    extreme = torch.where(-lo > hi, lo, hi)  # the signed weight of largest magnitude
    extreme = torch.where(extreme == 0, 0.0, extreme)  # +0 for an all-zero block, whichever zero amax met
    if not torch.isfinite(extreme).all():  # amax/amin propagate nan, so this sees every weight
        raise ValueError("weights contain inf or nan")
    d0 = (extreme / -8.0).to(torch.float16)
    q0, e0, qw, qq = _block_codes(blocks, d0)
    d1 = (qw / qq.clamp_min(1.0)).to(torch.float16)
    q1, e1, _, _ = _block_codes(blocks, d1)
    better = e1 < e0
    d = torch.where(better, d1, d0)
    if not torch.isfinite(d).all():
        raise ValueError("weights exceed the f16 range of Q4 scales")
    u = (torch.where(better, q1, q0) + Q4_ZERO).to(torch.uint8)  # [R, nb, 32], 0..15
    half = Q4_BLOCK // 2
    codes = u[..., :half] | (u[..., half:] << 4)  # [R, nb, 16]
    return codes.reshape(rows, nb * Q4_BLOCK_BYTES).contiguous(), d.reshape(rows, nb).contiguous()


def dequantize_q4(codes: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [R, cols] from Q4_G32 codes [R, nb*16] and f16 scales [R, nb]."""
    rows, nb = scales.shape
    packed = codes.reshape(rows, nb, Q4_BLOCK_BYTES)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float() - Q4_ZERO  # [R, nb, 32]
    return (q * scales.float().unsqueeze(-1)).reshape(rows, nb * Q4_BLOCK)[:, :cols]


# --- Q3_G32 and Q2_G32: low-bit record types, widened to Q4_G32 when read ------------------------
def quantize_low_bit(w: torch.Tensor, quant: QuantType) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_G32 or Q2_G32: w ~= d * (q - zero), one f16 d per 32 weights of a row (vault_format.md §4.5).

    With so few levels the side the extreme weight lands on matters, so the encoder tries both: the
    weight of largest magnitude on the most negative code (Q4_0's rule) and on the most positive one,
    each refit by least squares for its codes, and keeps the candidate with the smallest block error.

    Returns:
        codes: uint8 [R, nb * block bytes] (§4.5's bit order); scales: float16 [R, nb].
    """
    bits, _, zero = LOW_BIT_TYPES[quant]
    top = (1 << bits) - 1 - zero
    blocks = _padded_blocks(w)
    rows, nb, _ = blocks.shape
    hi, lo = blocks.amax(-1, keepdim=True), blocks.amin(-1, keepdim=True)
    extreme = torch.where(-lo > hi, lo, hi)
    if not torch.isfinite(extreme).all():
        raise ValueError("weights contain inf or nan")
    best_q = best_d = best_e = None
    for start in (extreme / -zero, extreme / top):
        d0 = start.to(torch.float16)
        q0, e0, qw, qq = _block_codes(blocks, d0, zero, top)
        d1 = (qw / qq.clamp_min(1.0)).to(torch.float16)
        q1, e1, _, _ = _block_codes(blocks, d1, zero, top)
        for q, d, e in ((q0, d0, e0), (q1, d1, e1)):
            if best_e is None:
                best_q, best_d, best_e = q, d, e
            else:
                better = e < best_e
                best_q, best_d, best_e = (torch.where(better, q, best_q), torch.where(better, d, best_d),
                                          torch.where(better, e, best_e))
    if not torch.isfinite(best_d).all():
        raise ValueError(f"weights exceed the f16 range of {quant.name} scales")
    return pack_low_bit((best_q + zero).to(torch.uint8), quant), best_d.reshape(rows, nb).contiguous()


def pack_low_bit(u: torch.Tensor, quant: QuantType) -> torch.Tensor:
    """Unsigned codes [R, nb, 32] into §4.5's bytes [R, nb * block bytes]: byte j < 8 of a block holds the
    low two bits of elements j, j+8, j+16 and j+24 (bits 0-1, 2-3, 4-5, 6-7); in Q3 byte 8+j < 12 holds
    the third bit of elements j, j+4, ..., j+28 (bits 0 to 7)."""
    rows, nb, _ = u.shape
    low = (u & 3).view(rows, nb, 4, 8)  # [.., i, j] is element 8i + j
    out = [low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)]
    if quant is QuantType.Q3_G32:
        high = (u >> 2).view(rows, nb, 8, 4)  # [.., i, j] is element 4i + j
        out.append(sum(high[:, :, i] << i for i in range(8)).to(torch.uint8))
    return torch.cat(out, -1).reshape(rows, -1).contiguous()


def unpack_low_bit(codes: torch.Tensor, quant: QuantType) -> torch.Tensor:
    """pack_low_bit's inverse: unsigned codes [R, nb, 32]."""
    _, block_bytes, _ = LOW_BIT_TYPES[quant]
    rows = codes.shape[0]
    packed = codes.reshape(rows, -1, block_bytes)
    nb = packed.shape[1]
    low = torch.stack([(packed[..., :8] >> (2 * i)) & 3 for i in range(4)], 2).reshape(rows, nb, 32)
    if quant is QuantType.Q2_G32:
        return low
    high = torch.stack([(packed[..., 8:12] >> i) & 1 for i in range(8)], 2).reshape(rows, nb, 32)
    return low | (high << 2)


def widen_to_q4(codes: torch.Tensor, quant: QuantType) -> torch.Tensor:
    """Q4_G32 codes of the same weights (exact: q - zero + 8 under the same scales): what a reader holds."""
    _, _, zero = LOW_BIT_TYPES[quant]
    u = unpack_low_bit(codes, quant) + (Q4_ZERO - zero)
    half = Q4_BLOCK // 2
    return (u[..., :half] | (u[..., half:] << 4)).reshape(codes.shape[0], -1).contiguous()


def dequantize_low_bit(codes: torch.Tensor, scales: torch.Tensor, cols: int, quant: QuantType) -> torch.Tensor:
    """float32 [R, cols] from Q3_G32 or Q2_G32 codes and f16 scales."""
    return dequantize_q4(widen_to_q4(codes, quant), scales, cols)


# --- FP8_B128 -----------------------------------------------------------------------------------
def _tiles(m: torch.Tensor) -> torch.Tensor:
    """[R, C] -> zero-padded float32 tiles [ceil(R/128), 128, ceil(C/128), 128]."""
    rows, cols = m.shape
    rb, cb = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    if (rows, cols) == (rb * FP8_BLOCK, cb * FP8_BLOCK):
        padded = m.float()
    else:
        padded = torch.zeros(rb * FP8_BLOCK, cb * FP8_BLOCK, dtype=torch.float32, device=m.device)
        padded[:rows, :cols] = m.float()
    return padded.view(rb, FP8_BLOCK, cb, FP8_BLOCK)


def _untile(tiles: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    rb, _, cb, _ = tiles.shape
    return tiles.reshape(rb * FP8_BLOCK, cb * FP8_BLOCK)[:rows, :cols]


def quantize_fp8(w: torch.Tensor, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8_B128 (quantize_fp8_reference's bytes) through the native encoder where the extension is built, on
    `threads` threads (default: every core); else the reference itself."""
    if _kernels is None:
        return quantize_fp8_reference(w)
    rows, cols = w.shape
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scales = torch.empty(-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK), dtype=torch.float32)
    src = w.contiguous().view(torch.uint16) if w.dtype == torch.bfloat16 else w.float().contiguous()
    status = _kernels.encode_fp8(threads or os.cpu_count() or 1, src.numpy(), codes.numpy(), scales.numpy())
    if status:
        raise ValueError(_ENCODE_ERRORS[status])
    return codes, scales


def quantize_fp8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8_B128: w ~= e4m3(q) * s, s = amax(tile) / 448 in f32 (1.0 for an all-zero tile).

    Returns:
        codes: uint8 [R, C], the E4M3FN bit patterns (round to nearest even).
        scales: float32 [ceil(R/128), ceil(C/128)].
    """
    rows, cols = w.shape
    tiles = _tiles(w)  # [rb, 128, cb, 128]
    if not torch.isfinite(tiles).all():
        raise ValueError("weights contain inf or nan")
    amax = tiles.abs().amax(dim=(1, 3))  # [rb, cb]
    scales = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (tiles / scales[:, None, :, None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    codes = _untile(q, rows, cols).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.contiguous(), scales.contiguous()


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [R, C] from E4M3FN codes (uint8 or float8) and tile scales of any float dtype."""
    rows, cols = codes.shape
    tiles = _tiles(codes.view(torch.float8_e4m3fn).float())
    return _untile(tiles * scales.float()[:, None, :, None], rows, cols).contiguous()


# --- MXFP4_G32 ----------------------------------------------------------------------------------
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # between magnitudes 0 .. 6
E2M1_MAX = 6.0
E2M1_EMAX = 2  # 6 = 1.5 * 2^2: the OCP shared exponent is floor(log2(amax)) - 2


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (sign bit 8, magnitude code 0..7) of x rounded to the nearest value, ties to the even
    code, saturating at 6."""
    mag = x.abs().clamp(max=E2M1_MAX)
    code = torch.bucketize(mag, _E2M1_MIDPOINTS)  # the lower code on a tie
    tie = (code < 7) & (mag == _E2M1_MIDPOINTS[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie.to(code.dtype)
    return (code | torch.where(x < 0, 8, 0)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4_G32 of float weights: per block of 32, the E8M0 exponent e of OCP's rule
    (floor(log2(amax)) - 2) or e + 1, whichever gives the smaller squared error, and E2M1 codes of w / 2^e
    rounded to nearest even. Columns past the last whole block are code 0. (From an MXFP4 checkpoint the
    converter copies its codes and scales instead.)

    Returns:
        codes: uint8 [R, ceil(C/32) * 16]; byte j of block b holds element 32b+2j (low nibble) and
            32b+2j+1 (high nibble), the OCP / checkpoint order.
        scales: uint8 [R, ceil(C/32)], E8M0.
    """
    rows, cols = w.shape
    nb = -(-cols // MXFP4_BLOCK)
    blocks = torch.zeros(rows, nb * MXFP4_BLOCK, dtype=torch.float32)
    blocks[:, :cols] = w.float()
    blocks = blocks.view(rows, nb, MXFP4_BLOCK)
    if not torch.isfinite(blocks).all():
        raise ValueError("weights contain inf or nan")
    amax = blocks.abs().amax(-1, keepdim=True)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - E2M1_EMAX
    best_codes, best_e, best_err = None, None, None
    for exp in (e, e + 1):
        exp = exp.clamp(-E8M0_BIAS, E8M0_NAN - 1 - E8M0_BIAS)
        codes = _e2m1_codes(blocks * torch.pow(2.0, -exp))
        err = ((_E2M1[codes.long()] * torch.pow(2.0, exp) - blocks) ** 2).sum(-1, keepdim=True)
        if best_codes is None:
            best_codes, best_e, best_err = codes, exp, err
        else:
            better = err < best_err
            best_codes = torch.where(better, codes, best_codes)
            best_e = torch.where(better, exp, best_e)
            best_err = torch.where(better, err, best_err)
    packed = best_codes[..., 0::2] | (best_codes[..., 1::2] << 4)  # [R, nb, 16]
    scales = (best_e + E8M0_BIAS).to(torch.uint8).reshape(rows, nb)
    return packed.reshape(rows, nb * MXFP4_BLOCK_BYTES).contiguous(), scales.contiguous()


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [R, cols] from MXFP4_G32 codes [R, nb*16] and E8M0 scales [R, nb] (255 decodes to NaN)."""
    rows, nb = scales.shape
    packed = codes.reshape(rows, nb, MXFP4_BLOCK_BYTES)
    lut = _E2M1.to(codes.device)
    values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1)  # [R, nb, 16, 2]
    exp = scales.to(torch.int32) - E8M0_BIAS
    w = torch.ldexp(values.reshape(rows, nb, MXFP4_BLOCK), exp[..., None].float())
    w = torch.where((scales == E8M0_NAN)[..., None], torch.full_like(w, float("nan")), w)
    return w.reshape(rows, nb * MXFP4_BLOCK)[:, :cols]
