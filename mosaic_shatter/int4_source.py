"""INT4 sources: compressed-tensors' `pack-quantized` format (Kimi-K2-Thinking's routed experts), symmetric
int4 in groups of 32 along the input dimension.

A quantised Linear `X` is stored as `X.weight_packed` (int32 [out, in / 8]: eight 4-bit codes a word, element
i at bits 4i..4i+3, each code the value plus 8), `X.weight_scale` ([out, in / 32], the model's float dtype)
and `X.weight_shape` (int32 [2]). The value of a weight is (code - 8) * scale.

That is the vault's Q4_G32 arithmetic (vault_format.md §4.1), so a Q4 vault takes the codes as they are, only
moved to its nibble order, and the scales converted to f16: exact for every scale f16 holds exactly (each
bf16 value from 2^-17 up to 65504, and 0), rounded to the nearest f16 below that.
"""

from __future__ import annotations

import torch

from mosaic_runtime.vault.format import Q4_BLOCK, Q4_BLOCK_BYTES

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
GROUP = 32
CODES_PER_WORD = 8


def weight_name(name: str) -> str:
    """The `.weight` a packed tensor stands for (the name a bf16 checkpoint gives it); other names as they are."""
    return name[: -len(PACKED)] + ".weight" if name.endswith(PACKED) else name


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (value + 8) of int32 words [out, in / 8]; byte j of a little-endian word holds
    elements 2j (low nibble) and 2j + 1 (high nibble)."""
    rows = packed.shape[0]
    b = packed.contiguous().view(torch.uint8).reshape(rows, -1)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(rows, -1)


def dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights [out, in] of a packed tensor and its group scales."""
    codes = unpack_codes(packed).to(torch.int16) - 8
    return (codes.view(codes.shape[0], -1, GROUP).float() * scale.float()[..., None]).reshape(codes.shape)


def as_q4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Q4_G32 planes (codes [out, in / 2], f16 scales [out, in / 32]) holding exactly the packed codes:
    byte j of a Q4 block holds elements j (low nibble) and j + 16 (high nibble) of its 32."""
    assert GROUP == Q4_BLOCK
    codes = unpack_codes(packed)
    rows = codes.shape[0]
    blocks = codes.view(rows, -1, 2, Q4_BLOCK_BYTES)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, -1), scale.to(torch.float16)


def scheme_problem(qcfg: dict) -> str | None:
    """Why a compressed-tensors quantization_config is not the scheme read here, or None when it is."""
    if qcfg.get("format") != "pack-quantized":
        return f"compressed-tensors format {qcfg.get('format')!r} is not supported (only 'pack-quantized')"
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return "compressed-tensors quantization_config has no config_groups"
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            return f"compressed-tensors group {name!r} has no weights scheme"
        got = (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"), w.get("group_size"))
        if got != (4, "int", True, "group", GROUP) or w.get("dynamic") or group.get("input_activations"):
            return (f"compressed-tensors group {name!r}: weights {got} are not supported (only int4, symmetric, "
                    f"groups of {GROUP}, weight-only)")
    return None
