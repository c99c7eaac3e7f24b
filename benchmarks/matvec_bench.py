"""One quantised matrix against n tokens through a kernel (`_native.kernels.matvec`, one thread): the cost a
token pays in a prefill, where each expert takes several tokens, against a decode step's one.

    python benchmarks/matvec_bench.py [--isa int8|float] [--tokens 1,8,32]

Prints microseconds per token and multiply-adds per second for the expert shapes of Qwen3-30B-A3B (both
directions) and gpt-oss-20b, in Q4_G32 and MXFP4_G32. The matrix is small enough to stay in cache: this
measures the arithmetic, not memory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mosaic_runtime import _native  # noqa: E402
from mosaic_runtime.vault.format import REQUIRED_SCALE_DTYPE, QuantType  # noqa: E402
from mosaic_runtime.vault.quant import quantize_mxfp4, quantize_q4  # noqa: E402

K = _native.kernels
SHAPES = [(768, 2048), (2048, 768), (2880, 2880)]  # [rows, cols]
QUANTS = {QuantType.Q4_G32: quantize_q4, QuantType.MXFP4_G32: quantize_mxfp4}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", choices=["int8", "float"], default="int8")
    ap.add_argument("--tokens", default="1,8,32")
    args = ap.parse_args()
    isa = K.int8_isa() if args.isa == "int8" else K.best_isa()
    if isa is None:
        sys.exit("this CPU has no int8-activation ISA")
    print(f"ISA {K.isa_name(isa)}, one thread")
    print("| quant | rows x cols | tokens | us per token | GMAC/s |")
    print("|---|---|---|---|---|")
    for quant, encode in QUANTS.items():
        for rows, cols in SHAPES:
            codes, scales = encode(torch.randn(rows, cols) * 0.02)
            c, s = (t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (codes, scales))
            for n in (int(t) for t in args.tokens.split(",")):
                x = np.random.default_rng(0).standard_normal((n, cols), dtype=np.float32)
                y = np.zeros((n, rows), np.float32)
                run = lambda: K.matvec(isa, int(quant), int(REQUIRED_SCALE_DTYPE[quant]), c, s, rows, cols, x, y)  # noqa: E731
                run()
                reps = max(3, 200 // n)
                t = time.perf_counter()
                for _ in range(reps):
                    run()
                dt = (time.perf_counter() - t) / reps
                print(f"| {quant.name} | {rows} x {cols} | {n} | {dt * 1e6 / n:.1f} | {rows * cols * n / dt / 1e9:.1f} |")


if __name__ == "__main__":
    main()
