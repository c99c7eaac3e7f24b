"""The engine under a memory limit it was not told about: `Engine.open` with no ram_budget inside a cgroup
v1 memory limit (RAM and page cache together, FACTS.md §3), against the same limit with the ring's budget
set by hand (the limit less what the engine needs besides its ring, as peer_bench's case b does). Each run
a fresh process after the page cache is dropped, the two interleaved; prints one JSON line per run and a
summary line.

    python benchmarks/memlimit_bench.py [--model bench-data/peer/qwen3-30b-a3b-8l-q4] [--fraction 0.5]
                                        [--rounds 3] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.convert_bench import drop_caches  # noqa: E402
from benchmarks.memlimit import run_worker  # noqa: E402
from benchmarks.peer_bench import ENGINE_BYTES, token_stream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "bench-data" / "peer" / "qwen3-30b-a3b-8l-q4"))
    ap.add_argument("--fraction", type=float, default=0.5, help="the limit, as a fraction of experts.vault")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    limit = int((Path(args.model) / "experts.vault").stat().st_size * args.fraction)
    stream = token_stream("a", args.prompt + args.tokens)
    base = dict(model=args.model, prompt=stream[:args.prompt], decode=stream[args.prompt:], threads=args.threads)
    runs: dict[str, list[dict]] = {"no ram_budget": [], "ram_budget by hand": []}
    for _ in range(args.rounds):
        for name, budget in (("no ram_budget", None), ("ram_budget by hand", limit - ENGINE_BYTES)):
            drop_caches()
            spec = dict(base, ram_budget=budget)
            cmd = [sys.executable, str(ROOT / "benchmarks" / "peer_bench.py"), "--worker", "mosaic", json.dumps(spec)]
            out = run_worker(cmd, limit, timeout=900)
            out.update(mode=name, limit=limit)
            runs[name].append(out)
            print(json.dumps({k: out[k] for k in ("mode", "limit", "decode_tok_s", "hit_rate", "cgroup_max_usage")}),
                  flush=True)
    med = {name: statistics.median(r["decode_tok_s"] for r in rs) for name, rs in runs.items()}
    print(json.dumps({"limit": limit, "median_tok_s": med,
                      "auto_vs_hand": med["no ram_budget"] / med["ram_budget by hand"]}))


if __name__ == "__main__":
    main()
