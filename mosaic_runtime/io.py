"""Reading whole expert records from the vault: Direct I/O (O_DIRECT on Linux, F_NOCACHE on macOS) or
buffered pread through the page cache."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading

from .vault.format import Reason, VaultError

IO_MODES = ("direct", "buffered")


class RecordReader:
    def __init__(self, path, io: str, notice=None):
        """Args:
            io: "direct" or "buffered". When the filesystem refuses Direct I/O, reads fall back to buffered
                and `notice` (if given) is called once with a one-line explanation.
        """
        if io not in IO_MODES:
            raise ValueError(f"io must be one of {IO_MODES}, not {io!r}")
        self.path, self.requested, self.notice = str(path), io, notice
        self.mode = io
        self._switch = threading.Lock()  # reads run on several threads; only one may fall back
        self._retired: list[int] = []
        self.fd = self._open(io)

    def _open(self, io: str) -> int:
        if io == "buffered":
            return os.open(self.path, os.O_RDONLY)
        if hasattr(os, "O_DIRECT"):
            try:
                return os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                return self._fall_back(f"{self.path}: the filesystem refuses O_DIRECT")
        fd = os.open(self.path, os.O_RDONLY)
        if sys.platform == "darwin":
            fcntl.fcntl(fd, 48, 1)  # F_NOCACHE: the macOS equivalent of O_DIRECT
        return fd

    def _fall_back(self, why: str) -> int:
        self.mode = "buffered"
        if self.notice is not None:
            self.notice(f"mosaic: {why}; reading experts through the page cache instead")
        return os.open(self.path, os.O_RDONLY)

    def read_into(self, buffer: memoryview, offset: int, length: int) -> None:
        """Fill buffer[:length] with the record at offset; a short read or an I/O error raises VaultError."""
        done = 0
        while done < length:
            try:
                got = os.preadv(self.fd, [buffer[done:length]], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and done == 0:
                    with self._switch:
                        if self.mode == "direct":
                            # The old descriptor stays open until close(): another thread may be using it.
                            self._retired.append(self.fd)
                            self.fd = self._fall_back(f"{self.path}: O_DIRECT read refused ({e.strerror})")
                    if self.mode == "buffered":
                        continue
                raise VaultError(Reason.TRUNCATED, f"read of {length} bytes failed: {e.strerror}", path=self.path,
                                 offset=offset + done) from None
            if got <= 0:
                raise VaultError(Reason.TRUNCATED, f"short read: {done} of {length} bytes", path=self.path,
                                 offset=offset + done)
            done += got

    def close(self) -> None:
        for fd in (self.fd, *self._retired):
            os.close(fd)
