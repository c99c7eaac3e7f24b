"""Write one vault file: space reserved first, records at their planned offsets, header last.

The writer walks an explicit state: OPEN (space reserved, header all zero) -> records written in any
order -> FINISHED (index, metadata and finally the header with its magic). A file whose writer did not
reach FINISHED has no magic, so no reader opens it (vault_format.md §10); a later writer of the same plan
may reopen it and keep the records that are whole (resume, recover).

Records go to the disk with Direct I/O (mosaic_runtime.io.open_direct) where the filesystem takes it: they
start on and span whole 16 KiB pages, and a buffered write spends a core's time copying them into the page
cache and writing the dirty pages back (1-2 s of system time for 1.3 GB of records on two cores, against
0.07 direct), time the encoders need. Header and metadata, written once at the end, stay buffered.
"""

from __future__ import annotations

import enum
import errno
import itertools
import mmap
import os
from dataclasses import replace

from mosaic_runtime.io import open_direct
from mosaic_runtime.vault.format import IndexEntry, QuantType, VaultHeader, crc32, pack_index

try:  # a convert runs without the compiled extension, but uses it when built
    from mosaic_runtime._native import io as native_io
except ImportError:
    native_io = None


def record_crc32(record) -> int:
    """A record's CRC-32: through the native core where it is built (PCLMUL or ARMv8 CRC32, several times
    zlib's speed, the same value), so the check costs the convert little next to its writes."""
    return crc32(record) if native_io is None else native_io.crc32(memoryview(record).cast("B"))


class DiskFull(OSError):
    """Not enough free space for an output file; raised before any data is written."""


def reserve(fd: int, size: int, path) -> None:
    """Allocate the whole file now, so a full disk fails here and not midway through."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFull(errno.ENOSPC, f"not enough free space for {size:,} bytes", str(path)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: the size is set, space is not promised


def _open_direct(path, fd: int) -> int | None:
    """A second descriptor of the file open as `fd`, for Direct I/O writes, or None where the filesystem
    refuses it (tmpfs)."""
    direct = open_direct(path, os.O_WRONLY)
    if direct is None:
        return None
    a, b = os.fstat(fd), os.fstat(direct)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # the path was replaced between the two opens
        os.close(direct)
        raise OSError(errno.ESTALE, "the file was replaced while being opened", str(path))
    return direct


def pwrite_all(fd: int, data, offset: int) -> None:
    """pwrite until every byte is written: a write may return short."""
    with memoryview(data) as view:
        view = view.cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            if n == 0:
                raise OSError(errno.EIO, "a write made no progress")
            view, offset = view[n:], offset + n


class State(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    FAILED = "failed"


class VaultWriter:
    def __init__(self, path, header: VaultHeader, keys: list[tuple[int, int]], resume: bool = False,
                 record_quants: list[QuantType] | None = None):
        """Args:
            path: the vault file to create.
            header: the planned header (offsets and sizes; meta_crc32 is computed here).
            keys: (layer, expert) of every record, in record order.
            resume: reopen an unfinished file of this plan (its size already reserved) instead of starting
                afresh; recover() then says which of its records are whole.
            record_quants: each record's own type, in record order, for a per-record header (plan_header's).
        """
        if len(keys) != header.num_records:
            raise ValueError(f"{len(keys)} keys for {header.num_records} records")
        if header.per_record_quant != (record_quants is not None):
            raise ValueError("record types are given exactly for a per-record header")
        self.path, self.header, self.keys = path, header, keys
        self.record_quants = record_quants
        self.lengths = ([header.stored_layout(q).record_bytes for q in record_quants] if record_quants
                        else [header.record_bytes] * len(keys))
        self.offsets = list(itertools.accumulate(self.lengths[:-1], initial=header.data_offset))  # contiguous
        self.crcs: list[int | None] = [None] * len(keys)
        self.state = State.OPEN
        resume = resume and os.path.isfile(path) and os.path.getsize(path) == header.file_size
        self.resumed = resume  # an unfinished file was reopened: recover() may take its records back
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if resume else os.O_TRUNC), 0o644)
        self.direct_fd: int | None = None
        self._staging: mmap.mmap | None = None
        try:
            if not resume:
                reserve(self.fd, header.file_size, path)
            self.direct_fd = _open_direct(path, self.fd)
            # Direct I/O moves the bytes by DMA from a page-aligned buffer, and a record comes as a bytearray
            # (not aligned): each is copied into this one.
            if self.direct_fd is not None and self.lengths:
                self._staging = mmap.mmap(-1, max(self.lengths))
            else:
                self._close_direct()
        except BaseException:
            self.abort()
            raise

    def recover(self, written: dict[int, int]) -> int:
        """Take back records an earlier writer of this file wrote ({record index: its CRC-32}), each only if
        its bytes on disk still have that CRC-32; returns how many were taken back."""
        taken = 0
        for i, crc in written.items():
            on_disk = os.pread(self.fd, self.lengths[i], self.record_offset(i)) if 0 <= i < len(self.crcs) else b""
            if on_disk and record_crc32(on_disk) == crc:
                self.crcs[i] = crc
                taken += 1
        return taken

    def sync(self) -> None:
        """Make the records written so far durable."""
        os.fsync(self.fd)

    def record_offset(self, i: int) -> int:
        return self.offsets[i]

    def write_record(self, i: int, record) -> None:
        if self.state is not State.OPEN:
            raise RuntimeError(f"writer is {self.state.value}")
        if len(record) != self.lengths[i]:
            raise ValueError(f"record {i} has {len(record)} bytes, expected {self.lengths[i]}")
        if self.direct_fd is not None and not self._write_direct(i, record):
            self._close_direct()  # the filesystem refuses direct writes after all: buffered from here on
        if self.direct_fd is None:
            pwrite_all(self.fd, record, self.record_offset(i))
        self.crcs[i] = record_crc32(record)

    def _write_direct(self, i: int, record) -> bool:
        """Write record i with Direct I/O; False if the filesystem refused it (EINVAL: alignment)."""
        try:
            with memoryview(self._staging) as staging:
                staging[:len(record)] = record
                pwrite_all(self.direct_fd, staging[:len(record)], self.record_offset(i))
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return False

    def finish(self, arch: bytes, lineage: bytes) -> None:
        """Write index and metadata, then the header, then fsync. Lengths must match the plan."""
        h = self.header
        if len(arch) != h.arch_length or len(lineage) != h.lineage_length:
            raise ValueError("metadata lengths differ from the planned header")
        missing = [self.keys[i] for i, c in enumerate(self.crcs) if c is None]
        if missing:
            raise RuntimeError(f"{len(missing)} records were never written, first {missing[0]}")
        quants = self.record_quants or [0] * len(self.keys)
        index = pack_index(IndexEntry(layer, expert, self.record_offset(i), self.lengths[i], self.crcs[i],
                                      int(quants[i])) for i, (layer, expert) in enumerate(self.keys))
        # The metadata region runs from arch_offset to data_offset, zero padding included (§3).
        meta = bytearray(h.data_offset - h.arch_offset)
        for offset, blob in ((h.arch_offset, arch), (h.lineage_offset, lineage), (h.index_offset, index)):
            start = offset - h.arch_offset
            meta[start:start + len(blob)] = blob
        pwrite_all(self.fd, meta, h.arch_offset)
        final = replace(h, meta_crc32=crc32(meta))
        os.fsync(self.fd)  # records and metadata are durable before the header makes them valid
        pwrite_all(self.fd, final.pack(), 0)
        os.fsync(self.fd)
        self._close_direct()
        os.close(self.fd)
        self.state = State.FINISHED

    def abort(self) -> None:
        if self.state is State.OPEN:
            self._close_direct()
            os.close(self.fd)
            self.state = State.FAILED

    def _close_direct(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None
        self._staging = None  # unmapped once no view of it is left (an exception's traceback may hold one)
