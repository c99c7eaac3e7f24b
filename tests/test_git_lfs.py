"""A git-lfs clone names each weight file's SHA-256 in its index: taken while git would call the file unchanged.

Built with the real git and git-lfs (a clone over file://), as a user's `git clone` of a Hugging Face repo.
CI installs git-lfs and sets MOSAIC_REQUIRE_GIT_LFS, so there these tests cannot skip themselves away.
"""

import hashlib
import os
import random
import shutil
import subprocess
import time

import pytest

from builders import tiny_qwen3_moe
from mosaic_runtime.vault import open_vault
from mosaic_shatter import source_hash
from mosaic_shatter.checkpoint import CheckpointError
from mosaic_shatter.convert import convert
from mosaic_shatter.git_lfs import _read_index, lfs_sha256

if shutil.which("git") is None or subprocess.run(["git", "lfs", "version"], capture_output=True).returncode:
    if os.environ.get("MOSAIC_REQUIRE_GIT_LFS"):
        raise RuntimeError("MOSAIC_REQUIRE_GIT_LFS is set but git or git-lfs is missing")
    pytest.skip("git-lfs is not installed", allow_module_level=True)


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def git(tmp_path, monkeypatch):
    """git with a configuration of its own: git-lfs's filters installed, nothing from the machine's."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for k, v in {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                 "GIT_COMMITTER_EMAIL": "t@t"}.items():
        monkeypatch.setenv(k, v)

    def run(*args, cwd):
        return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout
    run("lfs", "install", "--skip-repo", cwd=tmp_path)
    return run


def _clone(git, source, tmp_path):
    """`source`'s files committed with the weights in LFS, then cloned as a user would."""
    origin = tmp_path / "origin"
    shutil.copytree(source, origin)
    git("init", "-q", cwd=origin)
    git("lfs", "track", "*.safetensors", cwd=origin)
    git("add", ".", cwd=origin)
    git("commit", "-qm", "weights", cwd=origin)
    clone = tmp_path / "clone"
    git("clone", "-q", f"file://{origin}", str(clone), cwd=tmp_path)
    # Gigabytes of weights are written long before the clone writes its index; files this small can share
    # the index's timestamp, which leaves them "racily clean" until git next refreshes the index, as here.
    time.sleep(0.05)
    git("status", "--short", cwd=clone)
    return clone


def _cloned_weights(git, tmp_path, nbytes=1 << 20):
    """A clone of one random weight file and a config.json: (the weights in its work tree, its index)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(os.urandom(nbytes))
    (src / "config.json").write_text("{}")
    clone = _clone(git, src, tmp_path)
    return clone / "model.safetensors", clone / ".git" / "index"


def test_a_checked_out_lfs_file_is_named_by_its_pointer(git, tmp_path):
    weights, _ = _cloned_weights(git, tmp_path, 3 << 20)
    assert lfs_sha256(weights) == _sha256(weights)
    assert lfs_sha256(weights.parent / "config.json") is None  # in git itself, not LFS: hashed

    git("update-index", "--index-version", "4", cwd=weights.parent)  # paths stored prefix-compressed
    assert lfs_sha256(weights) == _sha256(weights)


def test_a_file_changed_since_the_checkout_is_hashed(git, tmp_path):
    weights, index = _cloned_weights(git, tmp_path)
    before = weights.stat()
    with open(weights, "r+b") as f:  # same size, other bytes
        f.write(b"edited")
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # even with its old mtime: the ctime tells
    later = time.time_ns() + 10**9
    os.utime(index, ns=(later, later))  # and the index written since, so not merely "racily clean"
    assert lfs_sha256(weights) is None
    assert source_hash.source_sha256(weights) == _sha256(weights)


def test_a_file_as_new_as_the_index_or_without_its_lfs_object_is_hashed(git, tmp_path):
    weights, index = _cloned_weights(git, tmp_path)
    # Racily clean: changed within the index's timestamp, git would read the file to tell.
    file_mtime = weights.stat().st_mtime_ns
    os.utime(index, ns=(file_mtime, file_mtime))
    assert lfs_sha256(weights) is None
    os.utime(index, ns=(file_mtime + 10**9, file_mtime + 10**9))
    assert lfs_sha256(weights) == _sha256(weights)
    shutil.rmtree(index.parent / "lfs" / "objects")  # `git lfs prune`d: nothing to name the pointer by
    assert lfs_sha256(weights) is None


def test_a_damaged_index_is_hashed_not_raised(git, tmp_path):
    weights, index = _cloned_weights(git, tmp_path)
    data = index.read_bytes()
    for cut in range(0, 200, 7):
        index.write_bytes(data[:cut])
        assert lfs_sha256(weights) is None
    index.write_bytes(b"DIRC" + (9).to_bytes(4, "big") + data[8:])
    assert lfs_sha256(weights) is None


def test_damaged_entries_under_a_valid_checksum_name_the_file_rightly_or_not_at_all(git, tmp_path):
    weights, index = _cloned_weights(git, tmp_path)
    right = _sha256(weights)
    git("update-index", "--index-version", "4", cwd=weights.parent)  # the varint paths too
    data = index.read_bytes()
    rng = random.Random(7)
    for _ in range(300):
        damaged = bytearray(data[:-20])
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(12, len(damaged))] = rng.randrange(256)
        index.write_bytes(bytes(damaged) + hashlib.sha1(damaged).digest())
        _read_index.cache_clear()  # the same size, perhaps the same mtime: not git's write of a new file
        assert lfs_sha256(weights) in (None, right)


def test_an_odd_repository_is_hashed_not_raised_or_waited_on(git, tmp_path):
    weights, index = _cloned_weights(git, tmp_path)
    clone = weights.parent
    assert lfs_sha256(weights) is not None
    shutil.move(clone / ".git", tmp_path / "repo.git")
    for dot_git in (b"gitdir: \xff\xfe", b"not a gitdir line", b""):
        (clone / ".git").write_bytes(dot_git)
        assert lfs_sha256(weights) is None
    (clone / ".git").write_text(f"gitdir: {tmp_path / 'repo.git'}\n")  # a linked work tree's form
    assert lfs_sha256(weights) == _sha256(weights)
    for commondir in (b"\xff\xfe", b"a\0b", b"../nowhere"):
        (tmp_path / "repo.git" / "commondir").write_bytes(commondir)
        assert lfs_sha256(weights) is None
    (tmp_path / "repo.git" / "commondir").unlink()
    (tmp_path / "repo.git" / "index").unlink()
    os.mkfifo(tmp_path / "repo.git" / "index")  # a read would block forever
    assert lfs_sha256(weights) is None


def test_a_clone_that_skipped_the_lfs_download_is_refused_until_pulled(git, tmp_path, monkeypatch):
    ckpt = tiny_qwen3_moe(tmp_path / "ckpt", seed=3)
    monkeypatch.setenv("GIT_LFS_SKIP_SMUDGE", "1")  # as `git clone` without git-lfs installed leaves it
    clone = _clone(git, ckpt, tmp_path)
    with pytest.raises(CheckpointError, match="model.safetensors: a git-lfs pointer.*run `git lfs pull` in"):
        convert(str(clone), tmp_path / "q4", "q4", progress=False)
    git("lfs", "pull", cwd=clone)
    with open_vault(convert(str(clone), tmp_path / "q4", "q4", progress=False).out) as v:
        files = {f["name"]: f["sha256"] for f in v.lineage["files"]}
    assert files["model.safetensors"] == _sha256(ckpt / "model.safetensors")


def test_convert_takes_the_lineage_hash_from_a_git_lfs_clone(git, tmp_path, monkeypatch):
    clone = _clone(git, tiny_qwen3_moe(tmp_path / "ckpt", seed=3), tmp_path)
    hashed = []
    real = source_hash.file_sha256
    monkeypatch.setattr(source_hash, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    with open_vault(convert(str(clone), tmp_path / "q4", "q4", progress=False).out) as v:
        files = {f["name"]: f["sha256"] for f in v.lineage["files"]}
    assert files["model.safetensors"] == _sha256(clone / "model.safetensors")
    assert "model.safetensors" not in hashed and "config.json" in hashed
