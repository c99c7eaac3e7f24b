"""The gated delta rule of a prefill at Qwen3.5-35B-A3B's geometry (16 key / 32 value heads of 128): the
native core's form (`_native.kernels.gated_delta_rule`, what a CPU prefill runs) beside the torch chunked
form (models/delta_rule.py, the reference, and what runs on other devices), interleaved in one process.

    python benchmarks/delta_rule_bench.py [--tokens 64,512,4096] [--threads 2] [--reps 5]

Prints per prompt length the milliseconds a layer's rule takes in each form (median of --reps, after one
warm-up each), the native form's speed-up, and the largest output difference between the two.
Subnormals are flushed as the engine flushes them (ops.flush_subnormals), so strong decays cost neither
form a microcode assist.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mosaic_runtime.models.delta_rule import chunk_gated_delta_rule, native_gated_delta_rule  # noqa: E402
from mosaic_runtime.ops import using_threads  # noqa: E402

KEY_HEADS, VALUE_HEADS, DIM = 16, 32, 128


def inputs(t: int):
    g = torch.Generator().manual_seed(t)
    q = torch.nn.functional.normalize(torch.randn(t, KEY_HEADS, DIM, generator=g), dim=-1) * DIM ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, KEY_HEADS, DIM, generator=g), dim=-1)
    v = torch.randn(t, VALUE_HEADS, DIM, generator=g)
    return q, k, v, -torch.rand(t, VALUE_HEADS, generator=g) * 2, torch.rand(t, VALUE_HEADS, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,512,4096")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rep = VALUE_HEADS // KEY_HEADS
    print(f"{'tokens':>7} {'torch chunked ms':>17} {'native ms':>10} {'speed-up':>9} {'max |diff|':>11}")
    with using_threads(args.threads):
        for t in (int(x) for x in args.tokens.split(",")):
            q, k, v, g, beta = inputs(t)
            qr, kr = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
            forms = {"torch": lambda s: chunk_gated_delta_rule(qr, kr, v, g, beta, s),
                     "native": lambda s: native_gated_delta_rule(q, k, v, g, beta, s)}
            times: dict[str, list[float]] = {name: [] for name in forms}
            outs = {}
            for i in range(args.reps + 1):
                for name, run in forms.items():
                    state = torch.zeros(VALUE_HEADS, DIM, DIM)
                    t0 = time.perf_counter()
                    outs[name] = run(state)
                    if i:  # the first round warms up
                        times[name].append(time.perf_counter() - t0)
            ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            diff = float((outs["torch"] - outs["native"]).abs().max())
            print(f"{t:>7} {ms['torch']:>17.2f} {ms['native']:>10.2f} {ms['torch'] / ms['native']:>8.2f}x {diff:>11.2e}")


if __name__ == "__main__":
    main()
