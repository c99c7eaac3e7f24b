"""A prompt chunk's causal attention: torch's fused CPU kernel (models/base.prefill_attention) against the native
decode tasks taking a block of positions at a time (`_native.kernels.prefill_attention`), per ISA, side by side.

    python benchmarks/prefill_attention_bench.py [--isa avx2,avx512] [--threads 2] [--chunks 512:0,1024:4096]

For each head shape (Qwen3-30B-A3B: 32 query / 4 KV heads of 128; Qwen3.5-35B-A3B's attention layers: 16 / 2 of
256; DeepSeek-V3's latent attention: 128 heads over one head of 576, keys and values the same rows), cache dtype
(float32, bf16) and chunk (T new tokens after `start` cached ones), prints the best of --reps calls in
milliseconds, the multiply-adds a second (Q K^T and P V over the causal half of the chunk and all of what precedes
it), and each native ISA's speed-up over torch. The engines alternate call by call, so drift falls on all alike.
torch picks its own ISA: `ATEN_CPU_CAPABILITY=avx2` holds it to AVX2 (set before Python starts).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.attention_bench import HEADS  # noqa: E402
from benchmarks.matvec_bench import isas_of  # noqa: E402
from mosaic_runtime import _native  # noqa: E402
from mosaic_runtime.models.base import prefill_attention  # noqa: E402

K = _native.kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default="avx2,avx512", help="comma-separated ISA names (matvec_bench's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", default="512:0,1024:0,1024:4096,1024:15360", help="tokens:start pairs")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    isas = isas_of(args.isa)
    names = [K.isa_name(i) for i in isas]
    torch.set_num_threads(args.threads)
    print(f"prompt attention, {args.threads} threads, best of {args.reps} calls a cell; ms and GMAC/s")
    print("| heads (q / kv x dim) | cache | tokens | from | torch ms | torch GMAC/s | "
          + " | ".join(f"{n} ms | {n} GMAC/s | {n} / torch" for n in names) + " |")
    print("|---|---|---|---|---|---" + "|---|---|---" * len(names) + "|")
    g = torch.Generator().manual_seed(0)
    for geometry, heads, kv_heads, dim, shared in HEADS:
        for dtype in (torch.float32, torch.bfloat16):
            for t, start in (tuple(int(x) for x in c.split(":")) for c in args.chunks.split(",")):
                q = torch.randn(t, heads, dim, generator=g)
                k = torch.randn(kv_heads, start + t, dim, generator=g).to(dtype)
                v = k if shared else torch.randn(kv_heads, start + t, dim, generator=g).to(dtype)
                kn, vn = ((x.view(torch.uint16) if dtype == torch.bfloat16 else x).numpy() for x in (k, v))
                fn = K.prefill_attention_bf16 if dtype == torch.bfloat16 else K.prefill_attention
                out = np.empty((t, heads * dim), np.float32)
                runs = [lambda: prefill_attention(q, k, v, start, dim ** -0.5)]
                runs += [lambda isa=isa: fn(isa, args.threads, q.numpy(), kn, vn, start, dim ** -0.5, out) for isa in isas]
                best = [float("inf")] * len(runs)
                for _ in range(args.reps + 1):  # the first round warms up
                    for i, run in enumerate(runs):
                        t0 = time.perf_counter()
                        run()
                        best[i] = min(best[i], time.perf_counter() - t0)
                macs = 2 * heads * t * (start + (t + 1) / 2) * dim
                cells = " | ".join(f"{b * 1e3:.1f} | {macs / b / 1e9:.0f} | {best[0] / b:.2f}x" for b in best[1:])
                cache = "float32" if dtype == torch.float32 else "bf16"
                print(f"| {heads} / {kv_heads} x {dim} ({geometry}) | {cache} | {t} | {start} | {best[0] * 1e3:.1f} | "
                      f"{macs / best[0] / 1e9:.0f} | {cells} |")


if __name__ == "__main__":
    main()
