"""Faults on the real read path mid-decode. A read that fails (EIO) or comes back short is injected with
the native ring's test hook (inject_faults: no failing device can be made here); a real short read comes
from truncating the vault under an open engine. After each: a VaultError naming the record, every ring
slot either empty or holding its record's checked bytes, and the next request giving the tokens a clean
engine gives."""

import errno
import shutil
import zlib

import numpy as np
import pytest

from builders import random_qwen3_moe
from mosaic_runtime import VaultError, open_vault
from mosaic_runtime.cache.ring import SlotState
from mosaic_runtime.engine import Engine
from mosaic_shatter.convert import convert

PROMPT = [5, 17, 101, 64, 3, 250, 77, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    ckpt = random_qwen3_moe(root / "ckpt", seed=5, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=3)
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


def small(directory):
    """A ring of 4 slots for 24 records: every layer of every token reads."""
    rec = Engine.open(directory, ram_budget=1 << 30, max_seq=64, preload=False).vault.header.record_bytes
    return Engine.open(directory, ram_budget=4 * rec, max_seq=64, preload=False)


def tokens(engine) -> list[int]:
    return list(engine.generate_ids(PROMPT, max_new_tokens=6))


def assert_slots_consistent(engine):
    store = engine.store
    for slot in range(store.ring.n_slots):
        assert store.ring.state(slot) not in (SlotState.LOADING, SlotState.FAILED)
    for (layer, expert) in zip(*np.nonzero(store.slot_table >= 0)):
        slot = int(store.slot_table[layer, expert])
        entry = engine.vault.entry(int(layer), int(expert))
        assert zlib.crc32(bytes(store.ring.view(slot)[:entry.length])) == entry.crc32, (layer, expert)


@pytest.mark.parametrize("error, what", [(errno.EIO, "Input/output error"), (0, "short read")])
def test_an_injected_read_fault_is_one_error_and_the_engine_goes_on(model_dir, error, what):
    want = tokens(small(model_dir))
    engine = small(model_dir)
    engine.store.ring.native.inject_faults(1, error)
    with pytest.raises(VaultError, match=what) as e:
        tokens(engine)
    assert e.value.layer is not None and e.value.expert is not None  # it names the record
    assert_slots_consistent(engine)
    assert tokens(engine) == want


def test_a_vault_truncated_under_an_open_engine(model_dir, tmp_path):
    """A real short read: the file shrinks after open (another program, a failing network mount)."""
    d = tmp_path / "copy"
    shutil.copytree(model_dir, d)
    want = tokens(small(d))
    engine = small(d)
    path = d / "experts.vault"
    whole = path.read_bytes()
    first = min(e.offset for e in engine.vault.entries.values())
    with open(path, "r+b") as f:
        f.truncate(first)  # every record gone
    with pytest.raises(VaultError, match="short read"):
        tokens(engine)
    assert_slots_consistent(engine)
    path.write_bytes(whole)  # the file is back: so is the engine
    assert tokens(engine) == want


def test_a_disk_that_fills_mid_write_leaves_nothing_that_opens(tiny_dirs, tmp_path, monkeypatch):
    """A real ENOSPC from the kernel mid-write: a 96 KiB tmpfs (mounted here when the tests may mount), on
    which the space could not be reserved first (posix_fallocate unsupported, as on some filesystems) and
    the free-space check is told there is room. Convert fails with one error and leaves no output; what it
    wrote stays in its hidden partial directory (for a resume), which does not open as a vault."""
    import errno as errno_
    import os
    import subprocess
    from mosaic_shatter.convert import ConvertError, convert
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        def unsupported(fd, offset, length):
            raise OSError(errno_.EOPNOTSUPP, "Operation not supported")
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(os, "posix_fallocate", unsupported)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage)
        with pytest.raises(ConvertError, match="disk full|No space"):
            convert(str(tiny_dirs["per-expert"]), mnt / "out", "q4", progress=False)
        # No output; the work so far is kept, hidden, for a resume once there is room, and nothing opens.
        assert [p.name for p in mnt.iterdir()] == [".out.partial"]
        with pytest.raises(VaultError):
            open_vault(mnt / ".out.partial")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
