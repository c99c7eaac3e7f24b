"""Memory that shrinks after open: the ring gives slots back (least recently used first), preload stops,
and the slots come back when memory does; the tokens never change. With a probe under the test's control,
and for real: inside a cgroup v1 limit, another allocation in the same group while the engine sits idle."""

import json
import subprocess
import sys

import pytest

from builders import random_qwen3_moe
from mosaic_runtime.engine import Engine
from mosaic_runtime.limits import MemoryLimit
from mosaic_shatter.convert import convert
from test_limits import MIB, v1_group

PROMPT = [5, 17, 101, 64, 3, 9, 250, 12]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("pressure")
    ckpt = random_qwen3_moe(root / "ckpt", hidden_size=256, moe_intermediate_size=128, num_experts=64,
                            num_hidden_layers=16, num_experts_per_tok=4, eos_token_id=None)
    return convert(str(ckpt), root / "q4", "q4", progress=False).out


@pytest.fixture(scope="module")
def reference(model):
    with Engine.open(model, max_seq=64, watch_memory=False) as engine:
        return list(engine.generate_ids(PROMPT, max_new_tokens=16))


class Memory:
    """A probe whose answer the test sets."""

    def __init__(self, available: int):
        self.available = available

    def __call__(self) -> MemoryLimit:
        return MemoryLimit(self.available, "test")


def test_slots_go_back_first_to_evict_first_and_return_with_the_same_tokens(model, reference):
    with Engine.open(model, max_seq=64) as engine:
        engine.finish_preload()
        store, valve, record = engine.store, engine.valve, engine.vault.header.record_bytes
        valve.probe = memory = Memory(10 * valve.margin)
        assert list(engine.generate_ids(PROMPT, max_new_tokens=16)) == reference
        full = store.policy.usable
        assert full == engine.vault.header.num_records  # the whole vault was held
        oldest = [key for key, _ in store.eviction_order()][:10]
        memory.available = valve.margin - 10 * record
        assert valve.check(force=True) == -10 and store.policy.usable == full - 10
        assert all(store.slot_table[key] == -1 for key in oldest)  # the ten first in eviction order went
        assert list(engine.generate_ids(PROMPT, max_new_tokens=16)) == reference  # read again as needed
        memory.available = 0  # as low as it goes: one layer's top-k stay
        valve.check(force=True)
        assert store.policy.usable == engine.arch["num_experts_per_tok"]
        assert list(engine.generate_ids(PROMPT, max_new_tokens=16)) == reference
        memory.available = 2 * valve.margin + 20 * record  # back, past twice the margin: 20 slots return
        assert valve.check(force=True) == 20 and store.policy.usable == engine.arch["num_experts_per_tok"] + 20
        assert list(engine.generate_ids(PROMPT, max_new_tokens=16)) == reference
        assert valve.counters.lowest_usable == engine.arch["num_experts_per_tok"]


def test_preload_stops_when_memory_runs_short(model, reference):
    with Engine.open(model, max_seq=64, preload=False) as engine:
        store, valve = engine.store, engine.valve
        valve.probe = Memory(0)
        submit, started = store._submit, []

        # memory runs out at preload's 8th read
        def submit_then_run_short(slot, key, background=False, preload=False):
            submit(slot, key, background, preload)
            if preload:
                started.append(key)
                if len(started) == 8:
                    valve.check(force=True)

        store._submit = submit_then_run_short
        assert store.preload() == 8
        engine.finish_preload()
        assert store.io.preload_bytes <= 8 * engine.vault.header.record_bytes
        assert list(engine.generate_ids(PROMPT, max_new_tokens=16)) == reference


WORKER = """
import json, sys, threading, time
from pathlib import Path
from mosaic_runtime.engine import Engine
group, model, headroom, hog_mib = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
used = int((group / "memory.usage_in_bytes").read_text())
(group / "memory.limit_in_bytes").write_text(str(used + headroom))
prompt = [5, 17, 101, 64, 3, 9, 250, 12]
engine = Engine.open(model, max_seq=64)
engine.finish_preload()
before = list(engine.generate_ids(prompt, max_new_tokens=16))
full = engine.store.policy.usable
hog = []
for _ in range(hog_mib // 2):  # another allocation in the same group, while the engine is idle
    hog.append(bytearray(b"x" * (2 << 20)))
    time.sleep(0.1)
time.sleep(1.0)
during = engine.store.policy.usable
tokens = list(engine.generate_ids(prompt, max_new_tokens=16))
hog.clear()
time.sleep(1.5)
print(json.dumps({"full": full, "records": engine.vault.header.num_records, "during": during,
                  "lowest": engine.valve.counters.lowest_usable, "after": engine.store.policy.usable,
                  "same_tokens": tokens == before, "bound": engine.memory_limit.bound}))
"""


def test_inside_a_real_cgroup_the_engine_gives_memory_back_instead_of_being_killed(model):
    group = v1_group()
    if group is None:
        pytest.skip("no writable cgroup v1 memory controller here")
    try:
        headroom, hog = 128 * MIB, 64
        cmd = f"echo $$ > {group}/cgroup.procs; exec {sys.executable} -c '{WORKER}' {group} {model} {headroom} {hog}"
        res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]  # -9: OOM-killed
        out = json.loads(res.stdout.splitlines()[-1])
    finally:
        group.rmdir()
    assert out["full"] == out["records"] and out["bound"].startswith("cgroup v1")
    assert out["lowest"] < out["full"] and out["during"] < out["full"]  # it gave memory back
    assert out["after"] > out["during"]  # and took it again once the other allocation went
    assert out["same_tokens"], out
