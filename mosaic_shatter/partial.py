"""The partial directory of a convert under way: `.NAME.partial` beside the output NAME.

It holds the files being written and three files of bookkeeping: what the work is made from (source
files with their sizes and modification times, quant, kept parts, converter version), a lock (one convert
writes it at a time), and a journal of the vault records already written and made durable. A convert that
is interrupted, killed or fails leaves it; the same convert run again resumes from it, keeping the
backbone and every journaled record whose bytes still check, and any other convert starts it afresh.
The bookkeeping is removed before the directory is renamed into place.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
from pathlib import Path

STATE_FILE, JOURNAL_FILE, LOCK_FILE = ".resume.json", ".records", ".lock"


class PartialBusy(Exception):
    """Another convert holds the partial directory."""


class PartialDir:
    def __init__(self, out: Path, identity: dict):
        self.path = out.parent / f".{out.name}.partial"
        self.path.mkdir(exist_ok=True)
        self._lock = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise PartialBusy(f"another convert is writing {out} (its partial directory {self.path} is locked)") \
                from None
        saved = self._load()
        self.resumed = saved is not None and saved.get("identity") == identity
        if self.resumed:
            self.state = saved
        else:
            for p in self.path.iterdir():
                if p.name != LOCK_FILE:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.state = {"identity": identity, "created": created, "backbone": None}
            self._save()
        self._journal = open(self.path / JOURNAL_FILE, "a", encoding="ascii")

    @property
    def created(self) -> str:
        """When the work began: the lineage's `created`, the same however many runs it takes."""
        return self.state["created"]

    @property
    def backbone(self) -> dict | None:
        """The backbone file's {file, bytes, sha256} once it was written and made durable, else None."""
        return self.state["backbone"]

    def set_backbone(self, info: dict) -> None:
        self.state["backbone"] = info
        self._save()

    def written(self) -> dict[int, int]:
        """{record index: CRC-32} of the records journaled as written (a torn last line is ignored)."""
        out = {}
        for line in (self.path / JOURNAL_FILE).read_text(encoding="ascii", errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                out[int(parts[0])] = int(parts[1])
        return out

    def restart_journal(self) -> None:
        self._journal.truncate(0)

    def journal(self, records: list[tuple[int, int]]) -> None:
        """Note records as written; the caller has made their bytes durable first."""
        self._journal.write("".join(f"{i} {crc}\n" for i, crc in records))
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def finish(self) -> None:
        """Remove the bookkeeping: what is left is the model directory, ready to be renamed into place."""
        self._journal.close()
        for name in (STATE_FILE, JOURNAL_FILE, LOCK_FILE):
            (self.path / name).unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        if not self._journal.closed:
            self._journal.close()
        if self._lock >= 0:
            os.close(self._lock)  # the lock goes with it
            self._lock = -1

    def _load(self) -> dict | None:
        try:
            value = json.loads((self.path / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _save(self) -> None:
        tmp = self.path / (STATE_FILE + ".new")
        with open(tmp, "w") as f:
            json.dump(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / STATE_FILE)
