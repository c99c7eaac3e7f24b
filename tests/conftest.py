"""Shared fixtures: tiny checkpoints are built once per session, converted vaults once per (layout, quant)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

from builders import tiny_qwen3_moe, to_block_fp8
from mosaic_shatter.convert import convert

# CI replays the same examples every run (a failure there is then reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Per-expert and fused saves of the same tiny model (dense layer 1 interleaved, GQA, odd sizes)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "per-expert": tiny_qwen3_moe(root / "per_expert", mlp_only_layers=[1]),
        "fused": tiny_qwen3_moe(root / "fused", fused=True, mlp_only_layers=[1]),
    }


@pytest.fixture(scope="session")
def fp8_dirs(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("fp8")
    return {
        "bf16-scales": to_block_fp8(tiny_dirs["per-expert"], root / "bf16_scales", torch.bfloat16),
        "f32-scales": to_block_fp8(tiny_dirs["per-expert"], root / "f32_scales", torch.float32),
    }


@pytest.fixture(scope="session")
def converted(tmp_path_factory, tiny_dirs):
    """Converted model directories keyed by (layout, quant)."""
    root = tmp_path_factory.mktemp("vaults")
    cache = {}

    def get(layout: str, quant: str):
        if (layout, quant) not in cache:
            cache[(layout, quant)] = convert(str(tiny_dirs[layout]), root / f"{layout}-{quant}", quant,
                                             progress=False).out
        return cache[(layout, quant)]

    return get
