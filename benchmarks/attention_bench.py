"""Decode attention (one new token's query heads over a cached context) per ISA path, side by side.

    python benchmarks/attention_bench.py [--isa avx2,avx512] [--threads 1,2] [--lengths 600,4096,16384] [--cold]

For each head shape of a supported geometry (Qwen3-30B-A3B: 32 query / 4 KV heads of 128; Qwen3.5-35B-A3B's
attention layers: 16 / 2 of 256; DeepSeek-V3 and Kimi-K2's latent attention: 128 heads over one latent head of
576, keys and values the same rows) and cache dtype (float32, the default; bf16), prints the best of --reps calls
of `_native.kernels.decode_attention` in milliseconds per ISA, the K and V bytes read over that time, and each
ISA's time against the first's. ISAs alternate call by call, so the machine's drift falls on all alike. At
16k positions a layer's K and V (64 MB of float32 for Qwen3-30B) come from memory; at 600 they sit in cache,
unless `--cold`: then 64 MB is read before every call, as a decoded token streams a layer's weights between
one layer's attention and the next, so the K and V come from memory at every length.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.matvec_bench import isas_of  # noqa: E402
from mosaic_runtime import _native  # noqa: E402

K = _native.kernels
# (geometry, query heads, KV heads, dim, keys and values shared)
HEADS = [("Qwen3-30B-A3B", 32, 4, 128, False), ("Qwen3.5-35B-A3B", 16, 2, 256, False),
         ("DeepSeek-V3", 128, 1, 576, True)]


def cache(rng: np.random.Generator, kv_heads: int, length: int, dim: int, dtype: str) -> np.ndarray:
    x = rng.standard_normal((kv_heads, length, dim), dtype=np.float32)
    return x if dtype == "float32" else (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bit patterns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="avx2,avx512", help="comma-separated ISA names (matvec_bench's)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--lengths", default="600,4096,16384")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cold", action="store_true", help="flush the caches before every call (64 MB read)")
    args = ap.parse_args()
    isas = isas_of(args.isa)
    names = [K.isa_name(i) for i in isas]
    print(f"decode attention, best of {args.reps} calls a cell{', caches flushed before each' if args.cold else ''}; "
          "ms, K and V GB/s, and each ISA against the first")
    print("| heads (q / kv x dim) | cache | positions | threads | "
          + " | ".join(f"{n} ms | {n} GB/s" for n in names) + "".join(f" | {n} / {names[0]}" for n in names[1:]) + " |")
    print("|---|---|---|---" + "|---|---" * len(names) + "|---" * (len(names) - 1) + "|")
    rng = np.random.default_rng(0)
    flush = np.ones(64 << 20 >> 3) if args.cold else None
    for geometry, heads, kv_heads, dim, shared in HEADS:
        for dtype in ("float32", "bf16"):
            fn = K.decode_attention if dtype == "float32" else K.decode_attention_bf16
            for length in (int(n) for n in args.lengths.split(",")):
                q = rng.standard_normal((heads, dim), dtype=np.float32)
                k = cache(rng, kv_heads, length, dim, dtype)
                v = k if shared else cache(rng, kv_heads, length, dim, dtype)
                nbytes = k.nbytes if shared else k.nbytes + v.nbytes
                out = np.empty((heads, dim), np.float32)
                for threads in (int(t) for t in args.threads.split(",")):
                    best = [float("inf")] * len(isas)
                    for _ in range(args.reps):
                        for i, isa in enumerate(isas):
                            if flush is not None:
                                flush.sum()
                            t = time.perf_counter()
                            fn(isa, threads, q, k, v, dim ** -0.5, out)
                            best[i] = min(best[i], time.perf_counter() - t)
                    cells = " | ".join(f"{b * 1e3:.3f} | {nbytes / b / 1e9:.1f}" for b in best)
                    ratios = "".join(f" | {b / best[0]:.2f}x" for b in best[1:])
                    row = f"{heads} / {kv_heads} x {dim} ({geometry}) | {dtype} | {length} | {threads}"
                    print(f"| {row} | {cells}{ratios} |")


if __name__ == "__main__":
    main()
