"""One quantised matrix against n tokens through a kernel (`_native.kernels.matvec`, one thread): the cost a
token pays in a prefill, where each expert takes several tokens, against a decode step's one.

    python benchmarks/matvec_bench.py [--isa int8|float|NAME[,NAME...]] [--tokens 1,8,32]

Prints microseconds per token and multiply-adds per second for the expert shapes of Qwen3-30B-A3B (both
directions) and gpt-oss-20b, in Q4_G32 and MXFP4_G32. The matrix is small enough to stay in cache: this
measures the arithmetic, not memory. `--isa` takes the CPU's int8 or float path, or ISA names (`amx`,
`avx512-vnni`, `avx-vnni`, `avx2-int8`, ...) timed side by side, each against the first.
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


def isas_of(choice: str) -> list[int]:
    if choice in ("int8", "float"):
        isa = K.int8_isa() if choice == "int8" else K.best_isa()
        if isa is None:
            sys.exit("this CPU has no int8-activation ISA")
        return [isa]
    every = (K.SCALAR, K.AVX2, K.AVX512, K.AVX512_VNNI, K.AMX, K.AVX_VNNI, K.AVX2_INT8, K.NEON, K.NEON_DOT, K.NEON_I8MM)
    by_name = {K.isa_name(i): i for i in every}
    isas = []
    for name in choice.split(","):
        if name not in by_name or not K.isa_available(by_name[name]):
            sys.exit(f"--isa {name}: not an ISA this CPU runs")
        isas.append(by_name[name])
    return isas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="int8", help="int8, float, or comma-separated ISA names")
    ap.add_argument("--tokens", default="1,8,32")
    args = ap.parse_args()
    isas = isas_of(args.isa)
    names = [K.isa_name(i) for i in isas]
    print(f"ISAs {', '.join(names)}; one thread; GMAC/s, and each against the first")
    print("| quant | rows x cols | tokens | " + " | ".join(f"{n} us/token | {n} GMAC/s" for n in names)
          + "".join(f" | {n} / {names[0]}" for n in names[1:]) + " |")
    print("|---|---|---" + "|---|---" * len(names) + "|---" * (len(names) - 1) + "|")
    for quant, encode in QUANTS.items():
        for rows, cols in SHAPES:
            codes, scales = encode(torch.randn(rows, cols) * 0.02)
            c, s = (t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in (codes, scales))
            for n in (int(t) for t in args.tokens.split(",")):
                x = np.random.default_rng(0).standard_normal((n, cols), dtype=np.float32)
                y = np.zeros((n, rows), np.float32)
                runs = [lambda isa=isa: K.matvec(isa, int(quant), int(REQUIRED_SCALE_DTYPE[quant]), c, s, rows, cols,
                                                 x, y) for isa in isas]
                reps = max(3, 200 // n)
                best = [float("inf")] * len(isas)
                for _ in range(3):  # interleaved rounds, the best of each
                    for i, run in enumerate(runs):
                        run()
                        t = time.perf_counter()
                        for _ in range(reps):
                            run()
                        best[i] = min(best[i], (time.perf_counter() - t) / reps)
                cells = " | ".join(f"{dt * 1e6 / n:.1f} | {rows * cols * n / dt / 1e9:.1f}" for dt in best)
                ratios = "".join(f" | {best[0] / dt:.2f}x" for dt in best[1:])
                print(f"| {quant.name} | {rows} x {cols} | {n} | {cells}{ratios} |")


if __name__ == "__main__":
    main()
