"""How much memory this process may really take: the host's available memory, bounded by what a cgroup (v2
or v1) and the process's rlimits allow.

A container (`docker run --memory`, systemd's MemoryMax, Kubernetes) sets a cgroup limit that MemAvailable
does not show: an expert ring sized from MemAvailable alone there gets the process OOM-killed before its
first token. A cgroup's page cache counts against its limit but is given back under pressure, so the
inactive file pages are not counted as used.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


@dataclass(frozen=True)
class MemoryLimit:
    available: int  # bytes this process may still take
    bound: str  # what bounds it, for people: "MemAvailable", "cgroup v2 memory.max of /x (2.00 GiB)", ...


def memory_limit(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> MemoryLimit:
    """The tightest of MemAvailable (physical memory where there is none), the cgroup limits of this process
    and of the cgroups above it, and RLIMIT_AS / RLIMIT_DATA less what the process has mapped."""
    found = [_host(proc)]
    for line in _read(proc / "self" / "cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            found += _cgroup_v2(cgroups, path)
        elif "memory" in controllers.split(","):
            found += _cgroup_v1(cgroups / "memory", path)
    found += _rlimits(proc)
    return min(found, key=lambda m: m.available)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    for line in _read(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value) or 0
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _host(proc: Path) -> MemoryLimit:
    for line in _read(proc / "meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return MemoryLimit(int(line.split()[1]) * 1024, "MemAvailable")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # macOS, BSD: no /proc
    return MemoryLimit(physical, "physical memory")


def _cgroup_dirs(root: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors', innermost first. Inside a cgroup namespace the path is
    relative to the mount, which is then the cgroup itself."""
    rel = path.strip("/")
    start = root / rel if rel and (root / rel).is_dir() else root
    dirs = [start]
    while dirs[-1] != root and root in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return dirs


def _cgroup_v2(root: Path, path: str) -> list[MemoryLimit]:
    out = []
    for d in _cgroup_dirs(root, path):
        limits = [v for v in (_int(_read(d / "memory.max")), _int(_read(d / "memory.high"))) if v is not None]
        if not limits:
            continue
        used = (_int(_read(d / "memory.current")) or 0) - _stat(d / "memory.stat", "inactive_file")
        name = "memory.high" if _int(_read(d / "memory.high")) == min(limits) else "memory.max"
        out.append(MemoryLimit(max(0, min(limits) - max(0, used)), f"cgroup v2 {name} of {d} ({_gib(min(limits))})"))
    return out


def _cgroup_v1(root: Path, path: str) -> list[MemoryLimit]:
    for d in _cgroup_dirs(root, path):
        limit = _int(_read(d / "memory.limit_in_bytes"))
        hierarchical = _stat(d / "memory.stat", "hierarchical_memory_limit") or UNLIMITED
        if limit is None:
            continue
        limit = min(limit, hierarchical)  # the tightest limit above this group, as the kernel applies it
        if limit >= UNLIMITED:
            return []
        used = (_int(_read(d / "memory.usage_in_bytes")) or 0) - _stat(d / "memory.stat", "total_inactive_file")
        return [MemoryLimit(max(0, limit - max(0, used)), f"cgroup v1 memory limit of {d} ({_gib(limit)})")]
    return []


def _rlimits(proc: Path) -> list[MemoryLimit]:
    out = []
    status = _read(proc / "self" / "status")
    for name, which, field in (("RLIMIT_AS", resource.RLIMIT_AS, "VmSize:"),
                               ("RLIMIT_DATA", resource.RLIMIT_DATA, "VmData:")):
        soft = resource.getrlimit(which)[0]
        if soft == resource.RLIM_INFINITY:
            continue
        mapped = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith(field)), 0)
        out.append(MemoryLimit(max(0, soft - mapped), f"{name} ({_gib(soft)})"))
    return out
