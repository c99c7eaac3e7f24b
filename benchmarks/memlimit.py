"""Run a benchmark worker in a fresh process, optionally under a cgroup v1 memory limit (FACTS.md §3: the
limit covers RAM and page cache together, as on a smaller machine), and read the JSON it prints last."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path


def run_worker(cmd: list[str], limit: int | None = None, timeout: float | None = None,
               env: dict[str, str] | None = None) -> dict:
    """The last stdout line of `cmd` as JSON; under a limit, with the group's peak usage added
    (`cgroup_max_usage`). A worker that fails raises RuntimeError with the end of its stderr. env: the
    worker's environment (default: this process's)."""
    if limit is None:
        return _last_json(subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env))
    cg_line = next(line for line in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in line)
    cg = Path("/sys/fs/cgroup/memory" + cg_line.split(":")[2]) / "mosaic-bench"
    cg.mkdir(exist_ok=True)
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        shell = f"echo $$ > {cg}/cgroup.procs; exec " + shlex.join(cmd)
        out = _last_json(subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=timeout,
                                        env=env))
        out["cgroup_max_usage"] = int((cg / "memory.max_usage_in_bytes").read_text())
        return out
    finally:
        cg.rmdir()


def _last_json(res: subprocess.CompletedProcess) -> dict:
    if res.returncode:
        raise RuntimeError(f"worker exited {res.returncode}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.splitlines()[-1])
