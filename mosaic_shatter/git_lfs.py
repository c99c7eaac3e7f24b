"""The SHA-256 git-lfs recorded for a file checked out in a git clone, when git would call the file unchanged.

`git clone https://huggingface.co/<repo>` with git-lfs installed leaves each weight file in the work tree and,
in the index, a pointer blob naming its SHA-256 (`oid sha256:<hex>`) and size. Git decides that a file is
unchanged since it was checked out by comparing its stat data with what the index recorded, without reading
it; so does this module. It reads the index itself rather than running git: a checkpoint's `.git/config` can
name commands (filters, an fsmonitor) that git would run, and a converter must not run what a download says.

The pointer blob is not read from git's object store either (a clone packs it): its id is the SHA-1 of a
pointer text that only the SHA-256 and the size determine, so each object git-lfs keeps in
`.git/lfs/objects/` is a candidate whose pointer id is computed and compared with the index entry's.
Anything unusual (a sha256-object-format repository, a pointer with extensions, a pruned LFS store, a file
touched since the checkout or within the index's own timestamp) gives None, and the file is hashed.
A clone that did not fetch its LFS objects has pointer files where the files belong: `is_lfs_pointer`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a SHA-256 as git-lfs and the Hub name objects
POINTER_VERSION = b"version https://git-lfs.github.com/spec/v1\n"  # a pointer file's first line
_POINTER_MAX = 1024  # the spec's bound on a pointer file's size
_ENTRY = struct.Struct(">10I20sH")  # ctime s, ns, mtime s, ns, dev, ino, mode, uid, gid, size; SHA-1; flags
_FLAG_EXTENDED = 0x4000  # in an entry's flags: two more bytes of flags follow (versions 3 and 4)
_FLAG_STAGE = 0x3000  # a merge conflict's side when not 0
_FLAG_NAME_LENGTH = 0x0FFF
_EXTENDED_SKIP_WORKTREE = 0x4000  # in the extended flags: the path is not in the work tree
_EXTENDED_KNOWN = 0x6000  # skip-worktree and intent-to-add; the rest is reserved, zero in any index git writes
_REGULAR_FILE = 0o100000
_MAX_INDEX_BYTES = 256 << 20  # a model repository's index is kilobytes
_MAX_SMALL_FILE = 1 << 20  # `.git` files, config, commondir
_PARSE_ERRORS = (OSError, ValueError, IndexError, struct.error)  # ValueError includes UnicodeDecodeError


@dataclass(frozen=True)
class GitIndexEntry:
    """What the index recorded about a work-tree file when git last wrote or checked it."""
    ctime: tuple[int, int]  # seconds (low 32 bits), nanoseconds
    mtime: tuple[int, int]
    ino: int  # low 32 bits, as every stat field here
    mode: int
    uid: int
    gid: int
    size: int
    blob: bytes  # SHA-1 of the staged content: for an LFS file, its pointer


def lfs_sha256(path: Path) -> str | None:
    """The SHA-256 of `path` as its git-lfs pointer records it, or None: not in such a checkout, changed since,
    or anything about the repository this reader does not take (it never raises for what it finds there)."""
    try:
        return _lfs_sha256(Path(os.path.abspath(path)))
    except _PARSE_ERRORS:
        return None


def _lfs_sha256(path: Path) -> str | None:
    root = next((parent for parent in path.parents if os.path.lexists(parent / ".git")), None)
    git_dir = _git_dir(root / ".git") if root is not None else None
    if git_dir is None:
        return None
    index = git_dir / "index"
    index_stat = index.stat()
    entries = _read_index(index, index_stat.st_mtime_ns, index_stat.st_size, index_stat.st_ino)
    entry = entries.get(path.relative_to(root).as_posix())
    file_stat = path.stat()
    if entry is None or not _unchanged(entry, file_stat) or file_stat.st_mtime_ns >= index_stat.st_mtime_ns:
        return None  # the last: "racily clean", changed within the index's own timestamp, as git would suspect
    for oid in _lfs_objects(_common_dir(git_dir) / "lfs" / "objects"):
        if _pointer_blob_id(oid, file_stat.st_size) == entry.blob:
            return oid
    return None


def _read_regular(path: Path, limit: int) -> bytes:
    """A regular file's bytes, up to `limit` of them: a FIFO or a device named by a repository would block the
    read or never end."""
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (no effect on a regular file)
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise ValueError(f"{path}: not a regular file of at most {limit} bytes")
        return f.read(limit + 1)


def _git_dir(dot_git: Path) -> Path | None:
    """The repository behind a work tree's `.git`: the directory itself, or where a `gitdir:` file points."""
    if dot_git.is_dir():
        git_dir = dot_git
    else:
        line = _read_regular(dot_git, _MAX_SMALL_FILE).decode("utf-8").strip()
        if not line.startswith("gitdir:"):
            return None
        git_dir = dot_git.parent / line.removeprefix("gitdir:").strip()
    config = _read_regular(_common_dir(git_dir) / "config", _MAX_SMALL_FILE).decode("utf-8", "replace")
    if re.search(r"^\s*objectformat\s*=\s*sha256", config, re.IGNORECASE | re.MULTILINE):
        return None  # object ids of 32 bytes: neither the index entries nor the pointer id below are SHA-1
    return git_dir


def _common_dir(git_dir: Path) -> Path:
    """A linked work tree's repository shares its LFS store and config with the main one (`commondir`)."""
    if not (git_dir / "commondir").exists():
        return git_dir
    return git_dir / _read_regular(git_dir / "commondir", _MAX_SMALL_FILE).decode("utf-8").strip()


@functools.lru_cache(maxsize=8)
def _read_index(index: Path, _mtime_ns: int, _size: int, _ino: int) -> dict[str, GitIndexEntry]:
    """Stage-0, checked-out entries of a git index (versions 2-4), by path. Cached while the file is the same.
    Anything git itself would refuse raises ValueError."""
    data = _read_regular(index, _MAX_INDEX_BYTES)
    signature, version, count = struct.unpack_from(">4sII", data)
    if signature != b"DIRC" or version not in (2, 3, 4):
        raise ValueError(f"{index}: not a git index of version 2-4")
    if data[-20:] not in (hashlib.sha1(data[:-20]).digest(), bytes(20)):  # zeros: written with index.skipHash
        raise ValueError(f"{index}: checksum mismatch")
    end_of_entries = len(data) - 20
    entries: dict[str, GitIndexEntry] = {}
    at, previous = 12, b""
    for _ in range(count):
        *fields, blob, flags = _ENTRY.unpack_from(data, at)
        name_at = at + _ENTRY.size
        extended = 0
        if flags & _FLAG_EXTENDED:
            if version < 3:
                raise ValueError(f"{index}: extended flags in a version 2 index")
            (extended,) = struct.unpack_from(">H", data, name_at)
            if extended & ~_EXTENDED_KNOWN:
                raise ValueError(f"{index}: unknown extended flags")
            name_at += 2
        if version == 4:  # the path is the previous one less N bytes, then a NUL-terminated suffix
            strip, name_at = _varint(data, name_at)
            if strip > len(previous):
                raise ValueError(f"{index}: malformed name field")
            name_end = data.index(b"\0", name_at, end_of_entries)
            name = previous[:len(previous) - strip] + data[name_at:name_end]
            at = name_end + 1
        else:  # NUL-terminated, the entry padded to a multiple of 8 bytes
            name_end = data.index(b"\0", name_at, end_of_entries)
            name = data[name_at:name_end]
            at += (name_end - at + 8) & ~7
        if at > end_of_entries or (flags & _FLAG_NAME_LENGTH) != min(len(name), _FLAG_NAME_LENGTH):
            raise ValueError(f"{index}: malformed entry")
        previous = name
        if flags & _FLAG_STAGE or extended & _EXTENDED_SKIP_WORKTREE:
            continue
        ctime_s, ctime_ns, mtime_s, mtime_ns, _dev, ino, mode, uid, gid, size = fields
        entries[name.decode("utf-8", "surrogateescape")] = GitIndexEntry(
            (ctime_s, ctime_ns), (mtime_s, mtime_ns), ino, mode, uid, gid, size, blob)
    return entries


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """Git's offset varint (each continuation adds one before shifting), and where it ends."""
    c = data[at]
    value = c & 0x7F
    while c & 0x80:
        at += 1
        c = data[at]
        value = ((value + 1) << 7) | (c & 0x7F)
    return value, at + 1


def _unchanged(entry: GitIndexEntry, file_stat: os.stat_result) -> bool:
    """Git's test that a file is as the index recorded it (`ie_match_stat`), made stricter: times to the
    nanosecond, the ctime and the inode always (git may skip those by configuration), so that whatever git
    would call changed is changed here too."""
    low = 0xFFFFFFFF
    return (entry.mode & 0o170000 == _REGULAR_FILE
            and entry.mtime == ((file_stat.st_mtime_ns // 10**9) & low, file_stat.st_mtime_ns % 10**9)
            and entry.ctime == ((file_stat.st_ctime_ns // 10**9) & low, file_stat.st_ctime_ns % 10**9)
            and entry.ino == file_stat.st_ino & low and entry.uid == file_stat.st_uid & low
            and entry.gid == file_stat.st_gid & low and entry.size == file_stat.st_size & low)


def _lfs_objects(store: Path) -> list[str]:
    """The SHA-256 of every object in git-lfs's local store (`objects/ab/cd/abcd...`)."""
    return [p.name for p in store.glob("??/??/*") if SHA256_HEX.fullmatch(p.name)]


def _pointer_blob_id(oid: str, size: int) -> bytes:
    """The git blob id of the git-lfs pointer for an object (spec v1, no extensions)."""
    pointer = POINTER_VERSION + f"oid sha256:{oid}\nsize {size}\n".encode()
    return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).digest()


def is_lfs_pointer(path: Path) -> bool:
    """Whether the file is a git-lfs pointer: what a clone made without git-lfs's download (or with
    GIT_LFS_SKIP_SMUDGE) leaves in place of each file stored in LFS."""
    if path.stat().st_size > _POINTER_MAX:
        return False
    with open(path, "rb") as f:
        return f.read(len(POINTER_VERSION)) == POINTER_VERSION
