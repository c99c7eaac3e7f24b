"""Opening the vault for expert reads: Direct I/O (O_DIRECT on Linux, F_NOCACHE on macOS) or buffered
pread through the page cache. The reads themselves run on the native ring's I/O threads (cache/ring.py)."""

from __future__ import annotations

import errno
import fcntl
import os
import sys

IO_MODES = ("direct", "buffered")
F_NOCACHE = 48  # macOS fcntl: the equivalent of O_DIRECT


def open_for_reads(path, io: str, notice=None) -> tuple[int, int]:
    """(direct_fd or -1, buffered_fd) for the vault at path.

    io="direct" asks for Direct I/O; when the filesystem refuses it, the direct descriptor is -1, reads go
    through the page cache and `notice` (if given) is called once with a one-line explanation.
    """
    if io not in IO_MODES:
        raise ValueError(f"io must be one of {IO_MODES}, not {io!r}")
    path = str(path)
    buffered = os.open(path, os.O_RDONLY)
    if io == "buffered":
        return -1, buffered
    try:
        direct = open_direct(path, os.O_RDONLY)
    except OSError:
        os.close(buffered)
        raise
    if direct is not None:
        return direct, buffered
    if notice is not None:
        notice(f"mosaic: {path}: the filesystem refuses O_DIRECT; reading experts through the page cache instead")
    return -1, buffered


def open_direct(path, flags: int) -> int | None:
    """A descriptor of path (opened with flags) whose I/O bypasses the page cache: O_DIRECT, or F_NOCACHE on
    macOS; None where the filesystem refuses O_DIRECT (tmpfs). The caller keeps transfers aligned."""
    path = str(path)
    if sys.platform == "darwin":
        fd = os.open(path, flags)
        fcntl.fcntl(fd, F_NOCACHE, 1)
        return fd
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None
