"""probe on real-scale skeletons of the hybrid families (real tensor names and shapes, sparse data):
Qwen3.5-35B-A3B, Qwen3.6-35B-A3B and Qwen3-Next-80B-A3B against ../shared/checkpoints/TENSORS.md."""

import math
import re

import pytest

from builders import skeleton
from mosaic_shatter.checkpoint import Checkpoint
from mosaic_shatter.cli import probe_report
from mosaic_shatter.plan import make_plan

# TENSORS.md (compute_totals.py): tensor count, Q4 g32 vault bytes (codes + one f16 scale per 32), and the
# bf16 backbone "excluding MTP experts" (F32 tensors counted at 4 B), which still holds the MTP layer's
# other tensors and the vision tower; probe leaves both out (text-only) and stores F32 tensors as bf16.
EXPECTED = {
    "qwen3.5-35b-a3b": dict(tensors=1_811, q4=18_119_393_280, backbone_with_mtp=5_868_532_832, layers=40,
                            experts=(256, 8), mixers=(30, 10), left_out={"MTP head", "vision tower"}),
    "qwen3.6-35b-a3b": dict(tensors=1_811, q4=18_119_393_280, backbone_with_mtp=5_868_532_832, layers=40,
                            experts=(256, 8), mixers=(30, 10), left_out={"MTP head", "vision tower"}),
    "qwen3-next-80b-a3b-instruct": dict(tensors=75_944, q4=43_486_543_872, backbone_with_mtp=2 * 2_404_838_656,
                                        layers=48, experts=(512, 10), mixers=(36, 12), left_out={"MTP head"}),
}
_MTP_EXPERT = re.compile(r"mtp\.layers\.\d+\.mlp\.experts\.\d+\.")
_BYTES = {"BF16": 2, "F32": 4}


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-skeletons")
    return {name: skeleton(f"{name}.config.json", root / name) for name in EXPECTED}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_agrees_with_the_published_sizes(skeletons, name, monkeypatch):
    want = EXPECTED[name]
    monkeypatch.setattr(Checkpoint, "read", lambda *a, **k: pytest.fail("probe read a weight"))
    ckpt = Checkpoint(str(skeletons[name]))
    assert len(ckpt.tensors) == want["tensors"]
    plan = make_plan(ckpt)
    report = probe_report(ckpt, plan)
    assert report["problems"] == []
    assert report["num_layers"] == report["moe_layers"] == want["layers"]
    assert (report["num_experts"], report["top_k"]) == want["experts"]
    types = report["layer_types"]
    assert (types.count("linear_attention"), types.count("full_attention")) == want["mixers"]
    assert report["num_records"] * report["record_bytes"]["q4"] == want["q4"]  # records fill whole pages
    assert 0 < report["vault_bytes"]["q4"] - want["q4"] < 1 << 20
    assert set(report["left_out"]) == want["left_out"]
    # The backbone: TENSORS.md's figure minus the left-out tensors that figure counts (its F32 vectors stay F32).
    left_out = [t for n, t in ckpt.tensors.items() if n in plan.dropped and not _MTP_EXPERT.match(n)]
    expected = want["backbone_with_mtp"] - sum(_BYTES[t.dtype] * math.prod(t.shape) for t in left_out)
    assert report["backbone_bytes"] == expected
    assert not any(b.name.startswith(("model.language_model.", "mtp.", "model.visual.")) for b in plan.backbone)


BACKBONE_ALL = {"qwen3.5-35b-a3b": 7_479_145_568, "qwen3-next-80b-a3b-instruct": 8_030_902_784}  # TENSORS.md


@pytest.mark.parametrize("name", sorted(BACKBONE_ALL))
def test_keep_puts_the_mtp_head_and_vision_tower_in_the_backbone(skeletons, name):
    ckpt = Checkpoint(str(skeletons[name]))
    plan = make_plan(ckpt, frozenset({"mtp", "vision"}))
    assert plan.problems == [] and plan.dropped == {}
    assert plan.backbone_bytes == BACKBONE_ALL[name]
