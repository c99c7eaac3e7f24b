"""MXFP4 sources: gpt-oss's routed experts as released (`quantization_config.quant_method = "mxfp4"`).

A projection `X` of every expert of a layer is stored as `X_blocks` (uint8 [E, rows, cols / 32, 16]: per
block of 32 weights of a row, byte j holds element 2j in its low nibble and 2j + 1 in its high nibble, each
an E2M1 code), `X_scales` (uint8 [E, rows, cols / 32]: E8M0, the block's power of two 2^(s - 127)) and
`X_bias` (the model's float dtype, [E, rows]). gpt-oss's `gate_up_proj` interleaves its rows: even rows are
the gate, odd rows the up projection.

That is the vault's MXFP4_G32 arithmetic and byte order (vault_format.md §4.3), so an MXFP4 vault takes each
row's codes and scales as they are, bit for bit.
"""

from __future__ import annotations

import torch

from mosaic_runtime.vault.format import E8M0_NAN, MXFP4_BLOCK, MXFP4_BLOCK_BYTES

BLOCKS, SCALES, BIAS = "_blocks", "_scales", "_bias"


def weight_name(name: str) -> str:
    """The tensor a blocks tensor stands for (what a bf16 checkpoint names it); other names as they are."""
    return name[: -len(BLOCKS)] if name.endswith(BLOCKS) else name


def logical_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """[E, rows, cols] of the weights blocks [E, rows, cols / 32, 16] hold, or None for another shape."""
    if len(blocks_shape) != 4 or blocks_shape[-1] != MXFP4_BLOCK_BYTES:
        return None
    return (*blocks_shape[:2], blocks_shape[2] * MXFP4_BLOCK)


def as_planes(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's blocks [rows, cols / 32, 16] and scales [rows, cols / 32] as the vault's codes plane
    [rows, cols / 2] and scales plane: the same bytes.

    Raises:
        ValueError: a scale is 255, which E8M0 reserves for NaN: every weight of its block would be NaN.
    """
    if bool((scales == E8M0_NAN).any()):
        raise ValueError("an E8M0 scale is 255 (NaN)")
    return blocks.reshape(blocks.shape[0], -1).contiguous(), scales.contiguous()
