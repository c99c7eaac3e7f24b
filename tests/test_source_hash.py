"""The lineage's SHA-256 of a source file: what a Hugging Face download recorded, else computed."""

import hashlib
import os
import shutil
import time

from builders import tiny_qwen3_moe
from mosaic_runtime.vault import open_vault
from mosaic_shatter.convert import convert
from mosaic_shatter.source_hash import recorded_sha256, source_sha256

RECORDED = "ab" * 32  # a SHA-256 no file here has: seen in a lineage only if taken from the record


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _record(local_dir, name, etag, written):
    metadata = local_dir / ".cache" / "huggingface" / "download" / f"{name}.metadata"
    metadata.parent.mkdir(parents=True, exist_ok=True)
    metadata.write_text(f"0123abc\n{etag}\n{written}\n")


def test_a_plain_file_is_hashed(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(3 << 20))
    assert recorded_sha256(f) is None
    assert source_sha256(f) == _sha256(f)


def test_a_hub_cache_file_is_named_by_its_blob(tmp_path):
    blob = tmp_path / "blobs" / RECORDED
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    link = tmp_path / "snapshots" / "main" / "model.safetensors"
    link.parent.mkdir(parents=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    assert source_sha256(link) == RECORDED


def test_a_local_dir_download_is_named_by_its_metadata_while_the_file_is_not_newer(tmp_path):
    f = tmp_path / "sub" / "model.safetensors"
    f.parent.mkdir()
    f.write_bytes(b"weights")
    _record(tmp_path, "sub/model.safetensors", RECORDED, time.time() + 5)
    assert recorded_sha256(f) == RECORDED  # the record sits in the download's root, keyed by the relative path
    os.utime(f, (time.time() + 60, time.time() + 60))  # edited after the download
    assert recorded_sha256(f) is None and source_sha256(f) == _sha256(f)


def test_a_local_dir_record_that_is_not_a_sha256_is_not_taken(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    for etag, written in (("0" * 40, time.time() + 5),  # a git blob id: the ETag of a file not in LFS
                          (RECORDED, "yesterday")):  # a record this module cannot read
        _record(tmp_path, "config.json", etag, written)
        assert recorded_sha256(f) is None and source_sha256(f) == _sha256(f)
    (tmp_path / ".cache" / "huggingface" / "download" / "config.json.metadata").write_bytes(b"\xff\xfe\n")
    assert recorded_sha256(f) is None


def test_convert_takes_the_lineage_hash_from_a_local_dir_download(tmp_path):
    ckpt = tiny_qwen3_moe(tmp_path / "ckpt", seed=3)
    local = tmp_path / "local"
    shutil.copytree(ckpt, local)
    _record(local, "model.safetensors", RECORDED, time.time() + 5)
    with open_vault(convert(str(local), tmp_path / "q4", "q4", progress=False).out) as v:
        files = {f["name"]: f["sha256"] for f in v.lineage["files"]}
    assert files["model.safetensors"] == RECORDED
    assert files["config.json"] == _sha256(local / "config.json")
