"""probe on real-scale skeleton checkpoints (real headers, sparse data) and the CLI's refusals."""

import json
import os
import subprocess
import sys

import pytest

from builders import CONFIGS, skeleton
from mosaic_shatter.architectures import ARCHITECTURES
from mosaic_shatter.checkpoint import Checkpoint
from mosaic_shatter.cli import probe_report
from mosaic_shatter.convert import WORKERS_PER_CORE, default_workers
from mosaic_shatter.plan import make_plan

GiB = 2**30


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "mosaic_shatter.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory):
    root = tmp_path_factory.mktemp("skeletons")
    return {name: skeleton(f"{name}.config.json", root / name)
            for name in ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-235b-a22b")}


# Figures from ../shared/checkpoints/TENSORS.md (compute_totals.py), same scheme: 4-bit codes + one f16
# scale per 32 weights; the vault adds its metadata page(s) in front of the records.
EXPECTED = {
    "qwen3-30b-a3b": dict(tensors=18_867, backbone=3_082_186_752, q4_records=16_307_453_952, layers=48),
    "qwen3-30b-a3b-fp8": dict(tensors=37_491, backbone=3_082_186_752, q4_records=16_307_453_952, layers=48),
    "qwen3-235b-a22b": dict(tensors=36_945, backbone=15_994_477_568, q4_records=127_741_722_624, layers=94),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_agrees_with_the_published_sizes(skeletons, name, monkeypatch):
    want = EXPECTED[name]

    def no_weights(*a, **k):
        raise AssertionError("probe read a weight")
    monkeypatch.setattr(Checkpoint, "read", no_weights)
    ckpt = Checkpoint(str(skeletons[name]))
    assert len(ckpt.tensors) == want["tensors"]
    plan = make_plan(ckpt)
    report = probe_report(ckpt, plan)
    assert report["problems"] == []
    assert report["num_layers"] == want["layers"] and report["moe_layers"] == want["layers"]
    assert (report["num_experts"], report["top_k"]) == (128, 8)
    assert report["backbone_bytes"] == want["backbone"]
    records = report["num_records"] * report["record_bytes"]["q4"]
    assert records == want["q4_records"]
    assert 0 < report["vault_bytes"]["q4"] - records < 1 << 20
    assert report["peak_ram_bytes"] == plan.peak_ram_bytes(default_workers(plan))  # the convert's own workers
    assert plan.peak_ram_bytes(2) < 2 * GiB  # bounded, whatever the model size


def test_convert_workers_fit_the_memory(skeletons):
    """As many encoding threads as asked, fewer when their experts in flight would not fit (never none)."""
    plan = make_plan(Checkpoint(str(skeletons["qwen3-235b-a22b"])))
    assert plan.workers_for(1 << 50, 16) == 16
    assert plan.workers_for(plan.peak_ram_bytes(5), 16) == 5
    assert plan.workers_for(plan.peak_ram_bytes(5) - 1, 16) == 4
    assert plan.workers_for(0, 16) == 1 and plan.workers_for(1 << 50, 0) == 1
    assert 1 <= default_workers(plan) <= WORKERS_PER_CORE * (os.cpu_count() or 1)


def test_fp8_checkpoint_is_detected_for_pass_through(skeletons):
    ckpt = Checkpoint(str(skeletons["qwen3-30b-a3b-fp8"]))
    r = probe_report(ckpt, make_plan(ckpt))
    assert r["fp8_passthrough"] is True
    assert r["source_format"]["expert_dtype"] == "F8_E4M3" and r["source_format"]["fp8_scale_dtype"] == "BF16"
    # 3 x (768 x 2048 codes + 6 x 16 bf16 scales), padded to 289 pages.
    assert r["record_bytes"]["fp8"] == 289 * 16384
    assert r["expert_source_bytes"] == 3 * 768 * 2048


def test_probe_json_cli(skeletons):
    res = run_cli("probe", skeletons["qwen3-235b-a22b"], "--json")
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout)
    for key in ("model_type", "num_layers", "num_experts", "top_k", "vault_bytes", "backbone_bytes"):
        assert key in r
    assert r["model_type"] == "qwen3_moe" and set(r["vault_bytes"]) == {"q4", "fp8", "mxfp4"}
    assert r["source_format"]["files"] > 1  # sharded, read through its index


def test_probe_text_cli(skeletons):
    res = run_cli("probe", skeletons["qwen3-30b-a3b"])
    assert res.returncode == 0, res.stderr
    assert "48 (48 MoE, 0 dense)" in res.stdout and "top-8" in res.stdout and "ready to convert" in res.stdout


def test_unsupported_model_type_is_one_line_exit_2(tmp_path):
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    cfg["model_type"] = "dbrx"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")
    res = run_cli("probe", tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "'dbrx'" in res.stderr


# Each test builds its own skeleton: copying one would fill its holes (57 GB of real zeros).
def test_missing_shard_is_named(tmp_path):
    d = skeleton("qwen3-30b-a3b.config.json", tmp_path / "ck")
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    res = run_cli("probe", d)
    assert res.returncode == 2 and victim.name in res.stderr


def test_truncated_shard_is_named(tmp_path):
    d = skeleton("qwen3-30b-a3b.config.json", tmp_path / "ck")
    shard = sorted(d.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    res = run_cli("probe", d)
    assert res.returncode == 2 and "truncated" in res.stderr and shard.name in res.stderr


def test_problems_are_listed_and_convert_refuses(tmp_path):
    from builders import qwen3_moe_tensors, write_sparse_safetensors
    cfg = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    cfg.update(num_hidden_layers=2, num_experts=4, vocab_size=64, hidden_size=64, moe_intermediate_size=32,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    tensors = [t for t in qwen3_moe_tensors(cfg, fp8=False) if t[0] != "model.layers.1.mlp.experts.3.up_proj.weight"]
    write_sparse_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = run_cli("probe", tmp_path)
    assert res.returncode == 0 and "layer 1 expert 3: missing up projection" in res.stdout
    res = run_cli("convert", tmp_path, "-o", tmp_path / "out", "--quant", "q4")
    assert res.returncode == 2 and "missing up projection" in res.stderr and not (tmp_path / "out").exists()


def test_both_config_spellings_give_the_same_arch_block():
    hub = json.loads((CONFIGS / "qwen3-30b-a3b.config.json").read_text())
    v5 = dict(hub)
    v5["num_local_experts"] = v5.pop("num_experts")
    v5["rope_parameters"] = {"rope_theta": v5.pop("rope_theta"), "rope_type": "default"}
    v5.pop("rope_scaling")
    v5["dtype"] = v5.pop("torch_dtype")
    arch = ARCHITECTURES["qwen3_moe"].arch_block
    assert arch(hub, None) == arch(v5, None)
    assert arch(hub, None)["rope"] == {"theta": 1e6, "type": "default", "scaling": None, "partial_rotary_factor": 1.0}


def test_repo_id_from_the_offline_hub_cache(tmp_path, tiny_dirs):
    import os
    import shutil
    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-moe" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_dirs["per-expert"], snap)
    (cache / "models--acme--tiny-moe" / "refs").mkdir()
    (cache / "models--acme--tiny-moe" / "refs" / "main").write_text("a" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    res = run_cli("probe", "acme/tiny-moe", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["source"] == "acme/tiny-moe"
    res = run_cli("probe", "acme/not-downloaded", env=env)
    assert res.returncode == 2 and "hf download acme/not-downloaded" in res.stderr


def test_convert_and_verify_cli_find_a_flipped_byte(tiny_dirs, tmp_path):
    from builders import flip_byte
    from mosaic_runtime.vault import open_vault
    out = tmp_path / "out"
    res = run_cli("convert", tiny_dirs["fused"], "-o", out, "--quant", "fp8", "--quiet")
    assert res.returncode == 0, res.stderr
    assert run_cli("verify", out, "--quiet").returncode == 0
    with open_vault(out) as v:
        e = v.entry(2, 4)
    flip_byte(out / "experts.vault", e.offset + 1000)
    res = run_cli("verify", out, "--quiet")
    assert res.returncode == 1
    assert f"layer 2, expert 4, offset {e.offset}" in res.stderr
    flip_byte(out / "experts.vault", e.offset + 1000)
    flip_byte(out / "backbone.safetensors", 5000)
    res = run_cli("verify", out, "--quiet")
    assert res.returncode == 1 and "backbone.safetensors" in res.stderr


def test_shatter_works_without_the_compiled_extension(tiny_dirs, tmp_path):
    code = ("import sys; sys.modules['mosaic_runtime._native'] = None; "
            "from mosaic_shatter.cli import main; "
            f"sys.argv = ['mosaic-shatter', 'convert', {str(tiny_dirs['per-expert'])!r}, '-o', "
            f"{str(tmp_path / 'out')!r}, '--quant', 'q4', '--quiet']; main()")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
