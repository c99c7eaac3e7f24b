"""A prompt's MoE layer through the expert kernels: every expert's record streamed from memory once, as a
prefill meets them in the ring, against the same calls on one record that stays in cache.

    python benchmarks/prefill_moe_bench.py [--isa NAME] [--tokens 512] [--threads 2] [--reps 5]

For the Qwen3-30B-A3B (128 experts) and Qwen3.5-35B-A3B (256 experts) geometries, top-8 of random routing
(every expert takes tokens / experts * 8 of them on average), Q4 records. "Spread" walks a pool of more than
1 GiB of records, a layer's worth at a time, so that no record is in cache when its expert runs; "cached"
hands every expert the same record. Their ratio is what memory costs the prefill's experts beyond their
arithmetic. Interleaved rounds, the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.kernel_bench import records_pool  # noqa: E402
from benchmarks.matvec_bench import isas_of  # noqa: E402
from mosaic_runtime import _native  # noqa: E402
from mosaic_runtime.experts import expert_format  # noqa: E402
from mosaic_runtime.recipe import ExpertActivation  # noqa: E402
from mosaic_runtime.vault.format import QuantType  # noqa: E402

K = _native.kernels
GEOMETRIES = [("Qwen3-30B-A3B", 2048, 768, 128), ("Qwen3.5-35B-A3B", 2048, 512, 256)]  # (name, H, I, experts)
TOP_K = 8


def layer_calls(experts: int, tokens: int, seed: int = 0):
    """Random top-8 routing of `tokens` tokens: per expert, its tokens and their weights."""
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :TOP_K]
    per = [np.nonzero(ids == e)[0].astype(np.int32) for e in range(experts)]
    return per, [np.full(len(t), 1.0 / TOP_K, np.float32) for t in per]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="int8", help="int8 (this CPU's int8 loop) or an ISA name")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    isa = isas_of(args.isa)[0]
    print(f"ISA {K.isa_name(isa)}, {args.threads} threads, {args.tokens} tokens, top-{TOP_K} of random routing, Q4")
    print("| geometry | experts | spread ms | cached ms | spread GMAC/s | spread / cached time |")
    print("|---|---|---|---|---|---|")
    for name, hidden, inter, experts in GEOMETRIES:
        layout, pool = records_pool(QuantType.Q4_G32, hidden, inter)
        tokens, weights = layer_calls(experts, args.tokens)
        x = np.random.default_rng(1).standard_normal((args.tokens, hidden), dtype=np.float32)
        y = np.zeros_like(x)
        fmt = expert_format(layout, ExpertActivation())
        total, most = sum(len(t) for t in tokens), max(len(t) for t in tokens)
        scratch = np.zeros(K.scratch_floats(fmt, total, most, args.threads), np.float32)
        layers = pool.shape[0] // experts
        at = 0

        def run(records) -> float:
            t = time.perf_counter()
            K.moe_experts(isa, args.threads, fmt, records, tokens, weights, x, y, scratch)
            return time.perf_counter() - t

        run([pool[0]] * experts)  # warm
        spread, cached = [], []
        for _ in range(args.reps):
            spread.append(run([pool[(at % layers) * experts + e] for e in range(experts)]))
            at += 1
            cached.append(run([pool[0]] * experts))
        s, c = statistics.median(spread), statistics.median(cached)
        macs = total * 3 * hidden * inter
        print(f"| {name} {hidden} x {inter} | {experts} | {s * 1e3:.1f} | {c * 1e3:.1f} | {macs / s / 1e9:.0f} "
              f"| {s / c:.2f} |")
        del pool


if __name__ == "__main__":
    main()
