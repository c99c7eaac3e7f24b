"""The memory the process may really take: cgroup v2 and v1 trees and rlimits read as the kernel applies them
(fake /proc and cgroup trees), and the engine sizing its ring inside a real cgroup v1 memory limit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mosaic_runtime.limits import memory_limit

GIB, MIB = 1 << 30, 1 << 20


def tree(tmp_path: Path, cgroup: str, files: dict[str, str], available_kib: int = 64 << 20):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return proc, cg


def test_no_cgroup_limit_is_mem_available(tmp_path):
    proc, cg = tree(tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max\n"}, available_kib=8 << 20)
    assert memory_limit(proc, cg).available == 8 * GIB and memory_limit(proc, cg).bound == "MemAvailable"


def test_cgroup_v2_takes_the_tightest_ancestor_less_its_use_but_reclaimable_cache(tmp_path):
    proc, cg = tree(tmp_path, "0::/docker/abc\n", {
        "docker/memory.max": str(2 * GIB), "docker/memory.current": str(500 * MIB),
        "docker/memory.stat": f"anon 1\ninactive_file {100 * MIB}\n",
        "docker/abc/memory.max": "max\n", "docker/abc/memory.high": "max\n",
        "docker/abc/memory.current": str(300 * MIB)})
    got = memory_limit(proc, cg)
    assert got.available == 2 * GIB - 400 * MIB
    assert "memory.max" in got.bound and got.bound.rstrip(")").endswith("2.00 GiB") and "docker" in got.bound


def test_cgroup_v2_memory_high_below_max_bounds_it(tmp_path):
    proc, cg = tree(tmp_path, "0::/svc\n", {"svc/memory.max": str(4 * GIB), "svc/memory.high": str(3 * GIB),
                                            "svc/memory.current": str(GIB)})
    got = memory_limit(proc, cg)
    assert got.available == 2 * GIB and "memory.high" in got.bound


def test_cgroup_v1_hierarchical_limit_and_namespaced_path(tmp_path):
    # inside a cgroup namespace the path is "/" and the mount is the container's own group
    proc, cg = tree(tmp_path, "12:memory:/\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.stat": f"hierarchical_memory_limit {GIB}\ntotal_inactive_file {50 * MIB}\n",
        "memory/memory.usage_in_bytes": str(250 * MIB)})
    got = memory_limit(proc, cg)
    assert got.available == GIB - 200 * MIB and got.bound.startswith("cgroup v1")


def test_cgroup_v1_without_a_limit_is_ignored(tmp_path):
    proc, cg = tree(tmp_path, "4:memory:/x\n", {"memory/x/memory.limit_in_bytes": "9223372036854771712\n",
                                                "memory/x/memory.usage_in_bytes": str(GIB)})
    assert memory_limit(proc, cg).bound == "MemAvailable"


def test_an_address_space_rlimit_bounds_it():
    code = ("import resource; from mosaic_runtime.limits import memory_limit;"
            "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY));"
            "m = memory_limit(); print(m.available, m.bound)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "RLIMIT_AS" and 0 < int(out[0]) < 8 * GIB


# --- a real cgroup v1 memory limit (FACTS.md §3: v1 memory groups work here; v2 does not) -------------------
def v1_group() -> Path | None:
    line = next((l for l in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in l), None)
    if line is None:
        return None
    group = Path("/sys/fs/cgroup/memory" + line.split(":", 2)[2]) / f"mosaic-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


WORKER = """
import json, sys, time
from pathlib import Path
import torch
from mosaic_runtime.engine import Engine
group, model = Path(sys.argv[1]), sys.argv[2]
used = int((group / "memory.usage_in_bytes").read_text())
(group / "memory.limit_in_bytes").write_text(str(used + int(sys.argv[3])))  # the headroom this run gets
engine = Engine.open(model, max_seq=64)
engine.finish_preload()
ids = list(engine.generate_ids([5, 17, 101, 64, 3], max_new_tokens=24))
print(json.dumps({"slots": engine.store.ring.n_slots, "records": engine.vault.header.num_records,
                  "record": engine.vault.header.record_bytes, "bound": engine.memory_limit.bound,
                  "limit": int((group / "memory.limit_in_bytes").read_text()), "tokens": len(ids)}))
"""


def test_engine_sizes_its_ring_inside_a_real_cgroup_limit(tmp_path):
    """A vault of 64 MiB with 32 MiB of headroom under the limit: the ring must be sized from the limit, not
    from the host's MemAvailable (which would give it the whole vault, preload it, and get it OOM-killed)."""
    from builders import random_qwen3_moe
    from mosaic_shatter.convert import convert
    group = v1_group()
    if group is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    try:
        ckpt = random_qwen3_moe(tmp_path / "ckpt", hidden_size=256, moe_intermediate_size=128, num_experts=64,
                                num_hidden_layers=16, num_experts_per_tok=4, eos_token_id=None)
        model = convert(str(ckpt), tmp_path / "q4", "q4", progress=False).out
        headroom = 32 * MIB
        cmd = f"echo $$ > {group}/cgroup.procs; exec {sys.executable} -c '{WORKER}' {group} {model} {headroom}"
        res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]  # -9: OOM-killed
        out = json.loads(res.stdout.splitlines()[-1])
        peak = int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        group.rmdir()
    assert out["tokens"] == 24 and out["bound"].startswith("cgroup v1")
    assert out["slots"] * out["record"] <= headroom < out["records"] * out["record"]
    assert peak <= out["limit"]
