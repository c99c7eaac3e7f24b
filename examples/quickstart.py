"""The README's main command: build a small Qwen3-MoE checkpoint, probe it, shatter it, verify it, run it.

Until the bundled trained model arrives, the checkpoint is a randomly initialised one that transformers
builds here (a minute of CPU at most), so nothing is downloaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent / "demo"
CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=32,
              num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=2048,
              bos_token_id=1, eos_token_id=2)


def shatter(*args: str) -> None:
    cmd = [sys.executable, "-m", "mosaic_shatter.cli", *args]
    print("\n$ mosaic-shatter " + " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = ROOT / "tiny-qwen3-moe"
    if not (ckpt / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **CONFIG)).to(torch.bfloat16)
        model.save_pretrained(ckpt)
        print(f"built {ckpt} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, bf16)")
    shatter("probe", str(ckpt))
    for quant in ("q4", "fp8"):
        out = ROOT / f"tiny-qwen3-moe-{quant}"
        shutil.rmtree(out, ignore_errors=True)
        t = time.monotonic()
        shatter("convert", str(ckpt), "-o", str(out), "--quant", quant, "--quiet")
        print(f"  ({time.monotonic() - t:.1f} s)")
        shatter("verify", str(out), "--quiet")

    # The reading API the runtime uses: dequantise one expert from each vault and compare to the source.
    from safetensors import safe_open

    import mosaic_runtime
    src = safe_open(str(ckpt / "model.safetensors"), "pt")
    want = src.get_tensor("model.layers.1.mlp.experts.7.gate_proj.weight").float()
    for quant in ("q4", "fp8"):
        with mosaic_runtime.open_vault(ROOT / f"tiny-qwen3-moe-{quant}") as vault:
            gate, _, _ = vault.dequantize_expert(1, 7)
            rel = ((gate - want).norm() / want.norm()).item()
            print(f"{quant}: layer 1 expert 7 gate {tuple(gate.shape)}, relative error {rel:.4f} against the bf16 source")

    # The engine: greedy decode from the Q4 vault with a ring that holds a quarter of the experts.
    from mosaic_runtime import Engine
    out = ROOT / "tiny-qwen3-moe-q4"
    with mosaic_runtime.open_vault(out) as vault:
        budget = vault.header.num_records * vault.header.record_bytes // 4
    with Engine.open(out, ram_budget=budget, max_seq=256) as engine:
        prompt = [1, 17, 42, 99, 256, 1024, 7, 3]
        ids = list(engine.generate_ids(prompt, max_new_tokens=32))
        s = engine.stats
        print(f"\ngenerated {len(ids)} tokens (random weights, so no text): {ids[:12]} ...")
        print(f"TTFT {s.ttft_s * 1e3:.1f} ms, decode {s.tok_per_s:.1f} tok/s, ring {engine.store.ring.n_slots} of "
              f"{engine.vault.header.num_records} experts, hit rate {s.hit_rate:.2f}, "
              f"{s.bytes_read / 2**20:.1f} MiB read; per layer hits/misses "
              + ", ".join(f"{layer}: {s.hits[layer]}/{s.misses[layer]}" for layer in s.hits))


if __name__ == "__main__":
    main()
