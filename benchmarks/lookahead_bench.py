"""The router lookahead in the engine itself: the bundled model (a real trained MoE) decodes held-out text
one token at a time under a ring that holds a share of its experts, with the decode step's read-ahead on
the ring policy's statistics alone (the default) and guided by the router lookahead too
(`Engine.open(router_lookahead=True)`, models/lookahead.py), side by side.

    python benchmarks/lookahead_bench.py [--model examples/stdlib-moe] [--fractions 0.1,0.25,0.5]
                                         [--tokens 2048]

The tokens are fed, not sampled (teacher-forced, as a decode step would see them), in windows of 256
positions, the same text for both runs; each run is a fresh engine with Direct I/O (the ring is the only
cache). Printed per ring size and mode: the hit rate, the records read a token (demand misses and reads
ahead), the reads ahead a token and the share of them a layer then used, the guess precision by rank
(best first: how often a guess's i-th expert was one its layer's routing named, over the guessed layers),
whether the logits were the same bits in both modes (reading ahead changes what is held, never a result),
and tok/s: the bundled model's records are 55 KB, so a decode step here waits on each read's latency more
than on the disk's bandwidth (a model the size the engine is for reads megabytes a record).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
WINDOW = 256


def held_out_ids(engine, tokens: int) -> list[list[int]]:
    """Windows of held-out standard-library text (the bundled model never trained on it), as token ids."""
    from train_bundled import chat_turns, held_out, stdlib_files
    docs = [d for rel, text in stdlib_files() if held_out(rel) for d in [text] + chat_turns(rel, text)]
    ids = [i for d in docs for i in engine.codec.encode(d)][:tokens]
    return [ids[at:at + WINDOW] for at in range(0, len(ids), WINDOW)]


def run(vault: Path, fraction: float, tokens: int, lookahead: bool) -> dict:
    from mosaic_runtime.engine import Engine
    from mosaic_runtime.vault import open_vault
    index = open_vault(vault)  # the records alone: the ring's budget is a share of them
    budget = int(fraction * len(index.entries) * index.header.record_bytes)
    index.close()
    engine = Engine.open(vault, ram_budget=budget, io="direct", max_seq=WINDOW, router_lookahead=lookahead)
    digest = hashlib.sha256()
    n = 0
    t = time.perf_counter()
    for window in held_out_ids(engine, tokens):
        for pos, token in enumerate(window):  # position 0 starts afresh
            digest.update(engine._forward([token], pos).numpy().tobytes())
            n += 1
    elapsed = time.perf_counter() - t
    policy, io = engine.store.policy, engine.store.io
    hits = sum(c.hits for c in policy.counters.values())
    misses = sum(c.misses for c in policy.counters.values())
    out = dict(slots=policy.usable, hit_rate=hits / (hits + misses), reads=io.reads / n, ahead=io.ahead_reads / n,
               used=io.ahead_used / max(1, io.ahead_reads), precision=policy._precision.copy(),
               logits=digest.hexdigest()[:16], tok_per_s=n / elapsed)
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    from mosaic_shatter.convert import convert
    with tempfile.TemporaryDirectory() as tmp:
        vault = convert(str(args.model), Path(tmp) / "q4", "q4", progress=False).out
        print("| ring (share of the experts) | slots | read-ahead guided by | hit rate | records read / token "
              "| read ahead / token (share used) | guess precision by rank | tok/s | logits |")
        print("|---|---|---|---|---|---|---|---|---|")
        for fraction in (float(f) for f in args.fractions.split(",")):
            runs = {mode: run(vault, fraction, args.tokens, mode) for mode in (False, True)}
            same = runs[False]["logits"] == runs[True]["logits"]
            for mode, r in runs.items():
                guided = "router lookahead + statistics" if mode else "statistics"
                by_rank = np.asarray(r["precision"])[1:].mean(0)  # layer 0 is never guessed
                precision = "-" if not mode else " ".join(f"{p:.2f}" for p in by_rank)
                print(f"| {fraction:.0%} | {r['slots']} | {guided} | {r['hit_rate']:.3f} | {r['reads']:.2f} "
                      f"| {r['ahead']:.2f} ({r['used']:.2f}) | {precision} | {r['tok_per_s']:.0f} | "
                      f"{r['logits']}{' (the same)' if same else ' (DIFFERENT)'} |", flush=True)


if __name__ == "__main__":
    main()
