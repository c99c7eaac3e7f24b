"""convert on tiny transformers-built checkpoints: every expert and backbone tensor checked against the source."""

import errno
from dataclasses import replace
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from builders import flip_byte, tiny_qwen3_moe
from mosaic_runtime.vault import Reason, VaultError, open_vault
from mosaic_runtime.vault.format import BACKBONE_FILE, FP8_E4M3_MAX, VAULT_FILE
from mosaic_runtime.vault.quant import dequantize_fp8
from mosaic_runtime.vault.record import unpack_record
from mosaic_shatter.checkpoint import Checkpoint
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


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_every_expert_read_is_announced_to_the_kernel_first(tiny_dirs, tmp_path, monkeypatch, layout):
    """convert asks the kernel (posix_fadvise WILLNEED) for each expert's bytes before a worker reads them,
    so the disk reads ahead while every worker computes."""
    lock, announced, unannounced = threading.Lock(), set(), []
    fadvise, read = os.posix_fadvise, Checkpoint.read

    def recording_fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            with lock:
                announced.add((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        return fadvise(fd, offset, length, advice)

    def checked_read(self, name, index=()):
        info, at, _, nbytes = self._span(name, index)
        if ".experts." in name:
            with lock:
                if (str(info.file.resolve()), at, nbytes) not in announced:
                    unannounced.append((name, index))
        return read(self, name, index)

    monkeypatch.setattr(os, "posix_fadvise", recording_fadvise)
    monkeypatch.setattr(Checkpoint, "read", checked_read)
    convert(str(tiny_dirs[layout]), tmp_path / "out", "q4", progress=False)
    assert announced and not unannounced


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


def test_disk_full_while_reserving_keeps_the_work_for_a_resume(tiny_dirs, tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConvertError, match="disk full.*run the same command again to resume"):
        convert(str(tiny_dirs["per-expert"]), tmp_path / "out", "q4", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [".out.partial"]  # hidden, and no vault in it opens
    with pytest.raises(VaultError):
        open_vault(tmp_path / ".out.partial")
    monkeypatch.setattr(os, "posix_fallocate", real)  # space was freed
    convert(str(tiny_dirs["per-expert"]), tmp_path / "out", "q4", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and open_vault(tmp_path / "out").verify() == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        p.name for p in convert(str(tiny_dirs["per-expert"]), tmp_path / "again", "q4", progress=False).out.iterdir())


def _start_convert(src, out):
    code = ("import sys; from mosaic_shatter.cli import main; "
            f"sys.argv = ['mosaic-shatter', 'convert', {str(src)!r}, '-o', {str(out)!r}, '--quant', 'q4', '--quiet']; "
            "main()")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_records(parent, proc, journaled: bool = False):
    """The partial directory once its vault file exists (and, if journaled, once records are journaled)."""
    deadline = time.monotonic() + 120
    partial = parent / ".out.partial"
    while time.monotonic() < deadline and proc.poll() is None:
        if (partial / VAULT_FILE).exists() and (not journaled or (partial / ".records").stat().st_size > 0):
            return partial
        time.sleep(0.002)
    raise AssertionError("convert finished or died before its vault was started")


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory):
    """Big enough (about 2 s to convert) that a convert can be caught midway."""
    return tiny_qwen3_moe(tmp_path_factory.mktemp("slow") / "ckpt", hidden_size=256, moe_intermediate_size=512,
                          num_experts=64, num_hidden_layers=4, vocab_size=64, intermediate_size=128)


def records(vault_dir):
    with open_vault(vault_dir) as v:
        return {key: v.read_record(*key) for key in v.entries}


def test_a_killed_convert_leaves_nothing_that_opens_and_resumes(slow_ckpt, tmp_path):
    proc = _start_convert(slow_ckpt, tmp_path / "out")
    partial = _wait_for_records(tmp_path, proc, journaled=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out").exists()
    with pytest.raises(VaultError) as e:
        open_vault(partial)
    assert e.value.reason is Reason.BAD_MAGIC
    # A journaled record damaged since (a torn write, a bad sector) is not trusted: it is written again.
    journaled = [int(line.split()[0]) for line in (partial / ".records").read_text().splitlines()]
    # (the partial vault's header is still zero: where records go comes from a finished convert of the same plan)
    done = convert(str(slow_ckpt), tmp_path / "plan", "q4", progress=False).out
    with open_vault(done) as v:
        first = v.header.data_offset + journaled[0] * v.header.record_bytes
    flip_byte(partial / VAULT_FILE, first + 7)
    # The same convert again resumes: the journaled records are kept, and the result is the one an
    # uninterrupted convert makes.
    result = convert(str(slow_ckpt), tmp_path / "out", "q4", progress=False)
    assert result.resumed_records == len(set(journaled)) - 1 >= 31 and not partial.exists()
    assert open_vault(tmp_path / "out").verify() == []
    assert records(tmp_path / "out") == records(done)
    # Byte for byte the same as the uninterrupted convert, but for when each began (the lineage's `created`).
    assert (tmp_path / "out" / BACKBONE_FILE).read_bytes() == (done / BACKBONE_FILE).read_bytes()
    with open_vault(tmp_path / "out") as a, open_vault(done) as b:
        assert replace(a.header, meta_crc32=0) == replace(b.header, meta_crc32=0)
        assert a.arch == b.arch and {**a.lineage, "created": 0} == {**b.lineage, "created": 0}
        assert [a.entry(*k) for k in a.entries] == [b.entry(*k) for k in b.entries]
    assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())  # no bookkeeping left


def test_a_changed_source_starts_the_partial_work_afresh(slow_ckpt, tmp_path):
    import shutil
    src = tmp_path / "src"
    shutil.copytree(slow_ckpt, src)
    proc = _start_convert(src, tmp_path / "out")
    _wait_for_records(tmp_path, proc, journaled=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (src / "config.json").write_text((src / "config.json").read_text() + " ")  # edited since
    result = convert(str(src), tmp_path / "out", "q4", progress=False)
    assert result.resumed_records == 0 and open_vault(tmp_path / "out").verify() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_convert_says_how_to_resume(slow_ckpt, tmp_path, sig):
    proc = _start_convert(slow_ckpt, tmp_path / "out")
    _wait_for_records(tmp_path, proc, journaled=True)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err and b"run the same command again to resume" in err and b"Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == [".out.partial"]
    res = subprocess.run([sys.executable, "-m", "mosaic_shatter.cli", "convert", str(slow_ckpt), "-o",
                          str(tmp_path / "out"), "--quant", "q4", "--quiet"], capture_output=True, text=True)
    assert res.returncode == 0 and "resumed:" in res.stdout, res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_two_converts_to_one_output_do_not_mix(slow_ckpt, tmp_path):
    proc = _start_convert(slow_ckpt, tmp_path / "out")
    try:
        _wait_for_records(tmp_path, proc)
        with pytest.raises(ConvertError, match="another convert is writing"):
            convert(str(slow_ckpt), tmp_path / "out", "q4", progress=False)
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0 and open_vault(tmp_path / "out").verify() == []


def test_lineage_names_every_source_file_by_its_sha256(tmp_path):
    """A checkpoint in three shards: the lineage gives each source file's size and SHA-256."""
    ckpt = tiny_qwen3_moe(tmp_path / "ckpt", seed=5)
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    shards = {f"model-{i + 1:05d}-of-00003.safetensors": names[i::3] for i in range(3)}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, ckpt / shard, metadata={"format": "pt"})
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    with open_vault(convert(str(ckpt), tmp_path / "q4", "q4", progress=False).out) as v:
        files = {f["name"]: f for f in v.lineage["files"]}
    assert set(shards) | {"config.json"} <= set(files)
    for name, f in files.items():
        data = (ckpt / name).read_bytes()
        assert (f["bytes"], f["sha256"]) == (len(data), hashlib.sha256(data).hexdigest()), name
