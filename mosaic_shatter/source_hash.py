"""The SHA-256 of a source file for the lineage block, taken from what its download recorded when it can.

Hashing a checkpoint takes a core (1.3-1.8 GB/s with SHA-NI), as much as the encoders get on a two-core
machine, so a convert that hashes every byte runs well under the disk's speed. Hugging Face downloads
already know each weight file's SHA-256 (the Hub's ETag of a file stored in LFS):
- the Hub's cache keeps the bytes in `blobs/<sha256>` behind the snapshot's symlinks;
- `hf download --local-dir` writes `.cache/huggingface/download/<path>.metadata` into the directory:
  the commit, the ETag and when it was written. `huggingface_hub` trusts it while the file is no newer
  than that (one second of slack for coarse modification times), and so does this module;
- `git clone` with git-lfs leaves a pointer naming the SHA-256 in the index, trusted while git would call the
  file unchanged (`git_lfs.py`).
Anything else is hashed.
"""

from __future__ import annotations

import os
from pathlib import Path

from mosaic_runtime.vault.format import file_sha256

from .git_lfs import SHA256_HEX, lfs_sha256

_LOCAL_DIR_METADATA = Path(".cache") / "huggingface" / "download"


def source_sha256(path: Path) -> str:
    """The file's SHA-256: recorded by its download if it was, computed otherwise."""
    return recorded_sha256(path) or file_sha256(path)


def recorded_sha256(path: Path) -> str | None:
    """The SHA-256 a download (the Hub's cache, an `hf download --local-dir`, a git-lfs clone) recorded for the
    file, or None."""
    blob = Path(os.path.realpath(path)).name
    if SHA256_HEX.fullmatch(blob):
        return blob
    path = Path(os.path.abspath(path))
    for local_dir in path.parents:
        metadata = local_dir / _LOCAL_DIR_METADATA / f"{path.relative_to(local_dir)}.metadata"
        if metadata.is_file():
            return _local_dir_etag(path, metadata)
    return lfs_sha256(path)


def _local_dir_etag(path: Path, metadata: Path) -> str | None:
    """A `--local-dir` download's record of the file: its ETag when that is a SHA-256 and the file has not
    changed since (a file edited in place is newer than its record)."""
    try:
        _commit, etag, written, *_ = (line.strip() for line in metadata.read_text(encoding="utf-8").splitlines())
        fresh = path.stat().st_mtime - 1 <= float(written)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return etag if fresh and SHA256_HEX.fullmatch(etag) else None
