"""Backbone projections in Q4 (the `fast` default's backbone: the expert kernels' Q4 matvec, int8
activations where the CPU has them), one token, against this machine's memory-read roofline measured in the
same run.

    python benchmarks/projection_bench.py [--threads 2] [--reps 3]

Shapes are real models' [rows, cols]: DeepSeek-V3's o_proj, dense MLP and q_b_proj, the two halves of its
kv_b_proj as latent attention multiplies them (models/weights.split_kv_b), and Qwen3-30B-A3B's q_proj and
o_proj. Weights cycle through more than 1 GiB per shape so that nothing is served from the caches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.peer_bench import bandwidth  # noqa: E402
from mosaic_runtime.backbone import quantize_matrix  # noqa: E402
from mosaic_runtime.ops import linear, using_threads  # noqa: E402

SHAPES = {
    "DeepSeek-V3 o_proj": (7168, 16384),
    "DeepSeek-V3 dense down_proj": (7168, 18432),
    "DeepSeek-V3 dense gate_proj": (18432, 7168),
    "DeepSeek-V3 q_b_proj": (24576, 1536),
    "DeepSeek-V3 kv_b_proj, key half (uk_t)": (65536, 128),
    "DeepSeek-V3 kv_b_proj, value half (uv)": (16384, 512),
    "Qwen3-30B-A3B q_proj": (4096, 2048),
    "Qwen3-30B-A3B o_proj": (2048, 4096),
}
POOL_BYTES = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| projection | rows x cols | Q4 MB | ms | GB/s | of the same-run roofline |")
    print("|---|---|---|---|---|---|")
    for name, (rows, cols) in SHAPES.items():
        one = quantize_matrix(torch.randn(rows, cols, generator=g) * 0.02, "q4")
        size = one.codes.nbytes + one.scales.nbytes
        # copies, not views: each call reads memory no other call has just read
        pool = [one] + [type(one)(one.codes.clone(), one.scales.clone(), one.cols)
                        for _ in range(max(1, POOL_BYTES // size) - 1)]
        x = torch.randn(1, cols, generator=g)
        times, roofs = [], []
        with using_threads(args.threads):
            for m in pool:
                linear(x, m)
            for _ in range(args.reps):
                roofs.append(bandwidth(args.threads, reps=1))
                t = time.perf_counter()
                for m in pool:
                    linear(x, m)
                times.append((time.perf_counter() - t) / len(pool))
        dt, roof = statistics.median(times), statistics.median(roofs)
        print(f"| {name} | {rows} x {cols} | {size / 1e6:.1f} | {dt * 1e3:.2f} | {size / dt / 1e9:.1f} | "
              f"{size / dt / 1e9 / roof:.2f} |", flush=True)
    print(f"same-run streaming bandwidth {roof:.1f} GB/s ({args.threads} threads)")


if __name__ == "__main__":
    main()
