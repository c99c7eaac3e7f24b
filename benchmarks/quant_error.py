"""Reconstruction error of the vault's Q4_G32 and FP8_B128 against llama.cpp Q4_0 and S-MoE's g64 Q4,
on the same weights, at Qwen3-30B-A3B's expert shapes.

    python benchmarks/quant_error.py [--markdown]

No real checkpoint can be downloaded here, so the weights are synthetic, in the three shapes real expert
weights take: Gaussian (std 0.02, what initialisation and most of a trained matrix look like), Student-t
with 4 degrees of freedom (heavy tails), and Gaussian with 0.5 % outliers at 10x (the channel outliers
LLM weights are known for). Every scheme sees the very same matrices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mosaic_runtime.vault.quant import dequantize_fp8, dequantize_q4, quantize_fp8, quantize_q4  # noqa: E402

ROWS, COLS = 768, 2048  # gate/up of a Qwen3-30B-A3B expert


def q4_0(w: torch.Tensor) -> torch.Tensor:
    """llama.cpp Q4_0 (ggml-quants.c quantize_row_q4_0_ref): d = max/-8, q = floor(x/d + 8.5) in 0..15."""
    b = w.reshape(-1, 32)
    m = b.gather(1, b.abs().argmax(1, keepdim=True))
    d = (m / -8).half().float()
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = (b * inv + 8.5).floor().clamp(0, 15)
    return ((q - 8) * d).reshape(w.shape)


def smoe_g64(w: torch.Tensor) -> torch.Tensor:
    """S-MoE Q4 (FACTS.md §2): fp16 absmax per 64 weights of a row, levels (q - 7.5) / 7.5, no zero."""
    b = w.reshape(-1, 64)
    a = b.abs().amax(1, keepdim=True).half().float()
    q = torch.round(b / a.clamp_min(1e-30) * 7.5 + 7.5).clamp(0, 15)
    return ((q - 7.5) / 7.5 * a).reshape(w.shape)


def mosaic_q4(w: torch.Tensor) -> torch.Tensor:
    return dequantize_q4(*quantize_q4(w), w.shape[1])


def mosaic_fp8(w: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(w))


SCHEMES = [("Mosaic Q4_G32", 4.5, mosaic_q4), ("llama.cpp Q4_0", 4.5, q4_0), ("S-MoE Q4 g64", 4.25, smoe_g64),
           ("Mosaic FP8_B128 (f32 scales)", 8 + 32 / 128**2, mosaic_fp8)]


def weight_sets(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(ROWS, COLS, generator=g) * 0.02
    t4 = torch.distributions.StudentT(4.0).sample((ROWS, COLS)) * 0.014
    outliers = torch.randn(ROWS, COLS, generator=g) * 0.02
    outliers *= torch.where(torch.rand(ROWS, COLS, generator=g) < 0.005, 10.0, 1.0)
    return {"gaussian": gauss, "student-t(4)": t4, "gaussian + 0.5% 10x outliers": outliers}


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(COLS, 64)  # activations, for the error of W @ x
    print("| weights | scheme | bits/weight | relative RMSE | relative output error | RMSE / Q4_0 |")
    print("|---|---|---|---|---|---|")
    for wname, w in weight_sets().items():
        results = []
        for sname, bits, f in SCHEMES:
            r = f(w)
            results.append((sname, bits, ((r - w).norm() / w.norm()).item(),
                            ((r - w) @ x).norm().item() / (w @ x).norm().item()))
        q4_0_rmse = next(rel for sname, _, rel, _ in results if sname == "llama.cpp Q4_0")
        for sname, bits, rel, out in results:
            print(f"| {wname} | {sname} | {bits:.3f} | {rel:.4f} | {out:.4f} | {rel / q4_0_rmse:.3f} |")


if __name__ == "__main__":
    main()
