"""Shared fixtures: tiny checkpoints are built once per session, converted vaults once per (layout, quant)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# `make test-asan`: the sanitized build of the native module stands in for the installed one, before
# anything imports mosaic_runtime.
if os.environ.get("MOSAIC_NATIVE_MODULE"):
    _spec = importlib.util.spec_from_loader("mosaic_runtime._native", importlib.machinery.ExtensionFileLoader(
        "mosaic_runtime._native", os.environ["MOSAIC_NATIVE_MODULE"]))
    sys.modules["mosaic_runtime._native"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["mosaic_runtime._native"])

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

from builders import tiny_qwen3_moe, to_block_fp8  # noqa: E402
from mosaic_shatter.convert import convert  # noqa: E402

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
