"""Decode-time expert FFN (top-8 experts of a layer, one token) against this machine's memory-read
roofline measured in the same run, interleaved, and against torch F.linear on the same weights in bf16.

    python benchmarks/kernel_bench.py [--threads 2] [--reps 5] [--geometries gpt-oss-20b,...]

Weights cycle through more than 1 GiB of records so that nothing is served from the caches. Effective
bandwidth = bytes of the 8 records' planes / time of the call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mosaic_runtime import _native  # noqa: E402
from mosaic_runtime.experts import expert_format  # noqa: E402
from mosaic_runtime.recipe import ExpertActivation  # noqa: E402
from mosaic_runtime.vault.format import (PROJECTIONS, REQUIRED_SCALE_DTYPE, QuantType, ScaleDtype,  # noqa: E402
                                         projection_shape, record_layout)
from mosaic_runtime.vault.quant import quantize_fp8, quantize_mxfp4, quantize_q4  # noqa: E402
from mosaic_runtime.vault.record import pack_record  # noqa: E402

K = _native.kernels
# (name, H, I, expert biases); gpt-oss's experts carry biases, which its records hold
GEOMETRIES = [("Qwen3-30B-A3B", 2048, 768, False), ("Qwen3.5-35B-A3B", 2048, 512, False),
              ("Qwen3-235B-A22B", 4096, 1536, False), ("gpt-oss-20b", 2880, 2880, True)]
QUANTIZE = {QuantType.Q4_G32: quantize_q4, QuantType.FP8_B128: quantize_fp8, QuantType.MXFP4_G32: quantize_mxfp4}
LABELS = {QuantType.Q4_G32: "Q4_G32", QuantType.FP8_B128: "FP8_B128", QuantType.MXFP4_G32: "MXFP4_G32"}
POOL_BYTES = 5 << 28  # 1.25 GiB of records per case
TOP_K = 8


def records_pool(quant: QuantType, hidden: int, inter: int, bias: bool = False):
    layout = record_layout(quant, REQUIRED_SCALE_DTYPE.get(quant, ScaleDtype.F32), hidden, inter, bias)
    g = torch.Generator().manual_seed(0)
    shapes = {p: projection_shape(p, hidden, inter) for p in PROJECTIONS}
    planes = {p: QUANTIZE[quant](torch.randn(*shapes[p], generator=g) * 0.02) for p in PROJECTIONS}
    biases = {p: torch.randn(shapes[p][0], generator=g) * 0.02 for p in PROJECTIONS} if bias else None
    one = np.frombuffer(bytes(pack_record(layout, planes, biases)), np.uint8)
    n = max(4 * TOP_K, POOL_BYTES // layout.record_bytes)
    pool = np.empty((n, layout.record_bytes), np.uint8)
    pool[:] = one  # identical content, distinct memory: every call streams from DRAM
    return layout, pool


def time_kernel(layout, pool, threads: int, calls: int, isa: int) -> float:
    hidden = layout.hidden
    x = np.random.default_rng(0).standard_normal((1, hidden), dtype=np.float32)
    y = np.zeros_like(x)
    tokens = [np.zeros(1, np.int32)] * TOP_K
    weights = [np.full(1, 1.0 / TOP_K, np.float32)] * TOP_K
    fmt = expert_format(layout, ExpertActivation())
    scratch = np.zeros(K.scratch_floats(fmt, TOP_K, 1, threads), np.float32)
    n = pool.shape[0]
    t = time.perf_counter()
    for c in range(calls):
        recs = [pool[(c * TOP_K + j) % n] for j in range(TOP_K)]
        K.moe_experts(isa, threads, fmt, recs, tokens, weights, x, y, scratch)
    return (time.perf_counter() - t) / calls


def time_torch(hidden: int, inter: int, threads: int, calls: int) -> float:
    torch.set_num_threads(threads)
    n = max(4 * TOP_K, POOL_BYTES // (3 * hidden * inter * 2))
    gate = torch.randn(n, inter, hidden, dtype=torch.bfloat16) * 0.02
    up = torch.randn(n, inter, hidden, dtype=torch.bfloat16) * 0.02
    down = torch.randn(n, hidden, inter, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, dtype=torch.bfloat16)
    t = time.perf_counter()
    for c in range(calls):
        y = torch.zeros(1, hidden, dtype=torch.bfloat16)
        for j in range(TOP_K):
            e = (c * TOP_K + j) % n
            y += F.linear(F.silu(F.linear(x, gate[e])) * F.linear(x, up[e]), down[e])
    return (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--geometries", default=",".join(g[0] for g in GEOMETRIES), help="comma-separated names")
    args = ap.parse_args()
    chosen = args.geometries.split(",")
    print(f"ISA {K.isa_name(K.best_isa())}, {args.threads} threads, top-{TOP_K}, one token, pools of "
          f"{POOL_BYTES / 2**30:.2f} GiB")
    print("| geometry (H x I) | quant, ISA | kernel GB/s | roofline GB/s (same run) | kernel / roofline | "
          "torch bf16 F.linear ms | Mosaic ms | speed-up vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for name, hidden, inter, bias in GEOMETRIES:
        if name not in chosen:
            continue
        torch_ms = time_torch(hidden, inter, args.threads, 40) * 1e3
        cases = [(QuantType.Q4_G32, K.best_isa()), (QuantType.FP8_B128, K.best_isa()),
                 (QuantType.MXFP4_G32, K.best_isa())]
        if K.int8_isa() is not None:  # the fast default's kernels (int8 activations; MXFP4's under VNNI)
            cases.insert(1, (QuantType.Q4_G32, K.int8_isa()))
            cases.append((QuantType.MXFP4_G32, K.int8_isa()))
        for quant, isa in cases:
            layout, pool = records_pool(quant, hidden, inter, bias)
            flat = pool.reshape(-1)
            moved = TOP_K * layout.payload_bytes
            calls = max(20, int(2 * pool.nbytes / moved))  # two passes over the pool
            time_kernel(layout, pool, args.threads, 5, isa)
            ratios, kern, roof = [], [], []
            for _ in range(args.reps):  # interleaved: the roofline is bimodal and drifts (FACTS.md §3)
                k = moved / time_kernel(layout, pool, args.threads, calls, isa) / 1e9
                t = time.perf_counter()
                K.stream_read(flat, args.threads)
                r = flat.nbytes / (time.perf_counter() - t) / 1e9
                kern.append(k)
                roof.append(r)
                ratios.append(k / r)
            ms = moved / statistics.median(kern) / 1e6
            label = f"{LABELS[quant]} {K.isa_name(isa)}"
            print(f"| {name} {hidden} x {inter} | {label} "
                  f"| {statistics.median(kern):.1f} | {statistics.median(roof):.1f} "
                  f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                  f"| {torch_ms:.2f} | {ms:.2f} | {torch_ms / ms:.1f}x |")
            del pool, flat


if __name__ == "__main__":
    main()
