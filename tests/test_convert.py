"""convert on tiny transformers-built checkpoints: every expert and backbone tensor checked against the source."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from builders import tiny_qwen3_moe
from mosaic_runtime.vault import Reason, VaultError, open_vault
from mosaic_runtime.vault.format import BACKBONE_FILE, FP8_E4M3_MAX, VAULT_FILE
from mosaic_runtime.vault.quant import dequantize_fp8
from mosaic_runtime.vault.record import unpack_record
from mosaic_shatter.convert import ConvertError, convert
from test_quant import q4_0_block_error

PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def source_expert(tensors, layer, expert):
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return [tensors[p + PROJ[k] + ".weight"].float() for k in ("gate", "up", "down")]


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("quant", ["q4", "fp8"])
def test_every_expert_matches_the_source(tiny_dirs, converted, layout, quant):
    src = load_file(tiny_dirs["per-expert"] / "model.safetensors")
    with open_vault(converted(layout, quant)) as v:
        assert v.moe_layers == [0, 2]  # layer 1 is dense (mlp_only_layers)
        assert len(v.entries) == 2 * 6
        for (layer, expert) in v.entries:
            for got, want in zip(v.dequantize_expert(layer, expert), source_expert(src, layer, expert)):
                assert got.shape == want.shape
                if quant == "q4":  # never worse than llama.cpp Q4_0, block by block
                    rows, cols = want.shape
                    nb = -(-cols // 32)
                    err = torch.zeros(rows, nb * 32)
                    err[:, :cols] = got - want
                    ours = (err.view(rows, nb, 32).double() ** 2).sum(-1).numpy()
                    assert (ours <= q4_0_block_error(want.numpy()) * (1 + 1e-5) + 1e-12).all()
                else:
                    amax = want.abs().max()
                    assert ((got - want).abs() <= want.abs() / 16 + amax / FP8_E4M3_MAX / 512).all()


@pytest.mark.parametrize("quant", ["q4", "fp8"])
def test_both_expert_layouts_give_identical_records(converted, quant):
    with open_vault(converted("per-expert", quant)) as a, open_vault(converted("fused", quant)) as b:
        assert a.layout == b.layout and a.arch == b.arch  # the lineage differs: it names the source
        for key in a.entries:
            assert a.read_record(*key) == b.read_record(*key)


def test_backbone_holds_everything_but_routed_experts(tiny_dirs, converted):
    src = load_file(tiny_dirs["per-expert"] / "model.safetensors")
    out = load_file(converted("per-expert", "q4") / BACKBONE_FILE)
    expected = {k for k in src if ".mlp.experts." not in k}
    assert set(out) == expected
    assert "model.layers.1.mlp.gate_proj.weight" in out  # the dense layer's MLP
    assert "model.layers.0.mlp.gate.weight" in out  # the router gate
    for k in expected:  # matrices in bf16; float32 vectors (norms here) stay float32
        want = src[k] if src[k].dim() == 1 and src[k].dtype == torch.float32 else src[k].to(torch.bfloat16)
        assert out[k].dtype == want.dtype and torch.equal(out[k], want), k


def test_arch_block_from_config(converted):
    with open_vault(converted("fused", "q4")) as v:
        a = v.arch
    assert a["layer_kinds"] == ["moe", "dense", "moe"]
    assert (a["num_experts"], a["num_experts_per_tok"], a["norm_topk_prob"]) == (6, 2, True)
    assert (a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]) == (4, 2, 16)
    assert a["rope"]["theta"] == 10000.0 and a["eos_token_ids"] == [2] and a["bos_token_id"] == 1


@pytest.mark.parametrize("scales", ["bf16-scales", "f32-scales"])
def test_fp8_source_passes_through_bit_exactly(fp8_dirs, tmp_path, scales):
    src_dir = fp8_dirs[scales]
    out = convert(str(src_dir), tmp_path / "out", "fp8", progress=False).out
    src = safe_open(str(src_dir / "model.safetensors"), "pt")
    with open_vault(out) as v:
        assert v.lineage["quant"]["passthrough"] is True
        assert v.lineage["quant"]["scale_dtype"] == scales.split("-")[0]
        for (layer, expert) in v.entries:
            planes = unpack_record(v.layout, v.read_record(layer, expert))
            for proj, (codes, scale) in planes.items():
                name = f"model.layers.{layer}.mlp.experts.{expert}.{PROJ[proj]}.weight"
                want_codes, want_scale = src.get_tensor(name), src.get_tensor(name + "_scale_inv")
                assert codes.numpy().tobytes() == want_codes.view(torch.uint8).numpy().tobytes()
                assert scale.dtype == want_scale.dtype
                assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    # FP8 attention weights reach the backbone dequantised to bf16; their scales are dropped.
    bb = load_file(out / BACKBONE_FILE)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q + "_scale_inv" not in bb
    want = dequantize_fp8(src.get_tensor(q), src.get_tensor(q + "_scale_inv")).to(torch.bfloat16)
    assert torch.equal(bb[q], want)


def test_fp8_source_to_q4(fp8_dirs, tmp_path):
    out = convert(str(fp8_dirs["bf16-scales"]), tmp_path / "q4", "q4", progress=False).out
    src = safe_open(str(fp8_dirs["bf16-scales"] / "model.safetensors"), "pt")
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    want = dequantize_fp8(src.get_tensor(name), src.get_tensor(name + "_scale_inv"))
    with open_vault(out) as v:
        got = v.dequantize_expert(2, 5)[2]
    assert ((got - want).norm() / want.norm()) < 0.12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tied_embeddings_and_half_precision_sources(tmp_path, dtype):
    ckpt = tiny_qwen3_moe(tmp_path / "tied", dtype=dtype, tie_word_embeddings=True, num_experts=3,
                          num_experts_per_tok=1, decoder_sparse_step=2)
    out = convert(str(ckpt), tmp_path / "out", "q4", progress=False).out
    src = load_file(ckpt / "model.safetensors")
    bb = load_file(out / BACKBONE_FILE)
    assert "lm_head.weight" not in bb
    with open_vault(out) as v:
        assert v.arch["tie_word_embeddings"] is True
        assert v.arch["layer_kinds"] == ["dense", "moe", "dense"]  # decoder_sparse_step=2
    # bf16 tensors are copied bit for bit; fp16 ones are rounded to bf16 once.
    assert all(torch.equal(bb[k], src[k].to(torch.bfloat16)) for k in bb)
    with open_vault(out) as v:
        want = src["model.layers.1.mlp.experts.2.up_proj.weight"].float()
        got = v.dequantize_expert(1, 2)[1]
        assert ((got - want).norm() / want.norm()) < 0.12


def test_existing_output_is_refused_then_replaced_with_force(tiny_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConvertError, match="exists"):
        convert(str(tiny_dirs["per-expert"]), out, "q4", progress=False)
    assert (out / "keep").exists()
    convert(str(tiny_dirs["per-expert"]), out, "q4", progress=False, force=True)
    assert not (out / "keep").exists() and open_vault(out).verify() == []


def test_not_enough_disk_is_refused_before_writing(tiny_dirs, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ConvertError, match="not enough disk"):
        convert(str(tiny_dirs["per-expert"]), tmp_path / "out", "q4", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_reserving_leaves_nothing(tiny_dirs, tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConvertError, match="disk full"):
        convert(str(tiny_dirs["per-expert"]), tmp_path / "out", "q4", progress=False)
    assert list(tmp_path.iterdir()) == []


def _start_convert(src, out):
    code = ("import sys; from mosaic_shatter.cli import main; "
            f"sys.argv = ['mosaic-shatter', 'convert', {str(src)!r}, '-o', {str(out)!r}, '--quant', 'q4', '--quiet']; "
            "main()")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_records(parent, proc):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in parent.glob(".out.partial-*") if (p / VAULT_FILE).exists()]
        if partial:
            return partial[0]
        time.sleep(0.002)
    raise AssertionError("convert finished or died before its vault was started")


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory):
    """Big enough (about 2 s to convert) that a convert can be caught midway."""
    return tiny_qwen3_moe(tmp_path_factory.mktemp("slow") / "ckpt", hidden_size=256, moe_intermediate_size=512,
                          num_experts=64, num_hidden_layers=4, vocab_size=64, intermediate_size=128)


def test_convert_killed_midway_leaves_nothing_that_opens(slow_ckpt, tmp_path):
    proc = _start_convert(slow_ckpt, tmp_path / "out")
    partial = _wait_for_records(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out").exists()
    with pytest.raises(VaultError) as e:
        open_vault(partial)
    assert e.value.reason is Reason.BAD_MAGIC
    # The next convert to the same output clears the dead process's partial directory.
    convert(str(slow_ckpt), tmp_path / "out", "q4", progress=False)
    assert not partial.exists() and open_vault(tmp_path / "out").verify() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_convert_cleans_up(slow_ckpt, tmp_path, sig):
    proc = _start_convert(slow_ckpt, tmp_path / "out")
    _wait_for_records(tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err and b"Traceback" not in err
    assert list(tmp_path.iterdir()) == []
