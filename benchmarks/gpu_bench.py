"""The device expert tier on a CUDA GPU: decode tok/s with 0 %, 10 %, 30 % and 100 % of the experts'
records allowed in VRAM, and the two promotion policies side by side on the same prompt and tokens.

    python benchmarks/gpu_bench.py [--layers 4] [--warm 64] [--tokens 32]

Model: the random-weight Qwen3-MoE with Qwen3-30B-A3B's per-layer geometry of benchmarks/e2e_bench.py,
Q4 vault. Each case opens a fresh engine with vram_budget = share x the vault's records, decodes --warm
tokens so the policy promotes what it will, then times --tokens more. Run by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.convert_bench import build_checkpoint  # noqa: E402

SHARES = (0.0, 0.1, 0.3, 1.0)


def decode_case(model: Path, share: float, policy: str, warm: int, tokens: int, device: str) -> dict:
    import torch

    from mosaic_runtime.engine import Engine
    from mosaic_runtime.vault import open_vault
    with open_vault(model) as vault:
        budget = int(share * vault.header.num_records) * vault.header.record_bytes
    with Engine.open(model, device=device, vram_budget=budget, tier_policy=policy, max_seq=512) as engine:
        prompt = [(17 * i + 5) % engine.arch["vocab_size"] for i in range(32)]
        out = list(engine.generate_ids(prompt, max_new_tokens=warm))
        engine._sync_stats()
        before = {layer: (c.hits, c.misses) for layer, c in engine.stats.tier.items()}
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out += list(engine.generate_ids([out[-1]], max_new_tokens=tokens, cached=engine.model.state.length))
        elapsed = time.perf_counter() - t
        engine._sync_stats()
        hits = sum(c.hits - before.get(k, (0, 0))[0] for k, c in engine.stats.tier.items())
        misses = sum(c.misses - before.get(k, (0, 0))[1] for k, c in engine.stats.tier.items())
        tier = engine.model.experts
        return {"tok_s": tokens / elapsed, "hit_rate": hits / max(1, hits + misses),
                "resident": len(tier.cache.where), "capacity": tier.cache.capacity,
                "promotions": sum(c.promotions for c in engine.stats.tier.values()),
                "crossover": tier.cost.crossover_tokens, "tokens": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warm", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", help='"cpu" dry-runs the tier with host memory as the device')
    args = ap.parse_args()
    import torch
    data = ROOT / "bench-data"
    ckpt = build_checkpoint(data / f"qwen3-30b-geometry-{args.layers}l", args.layers)
    model = data / f"e2e-{args.layers}l-q4"
    if not (model / "experts.vault").exists():
        from mosaic_shatter.convert import convert
        convert(str(ckpt), model, "q4", progress=False, force=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "host-memory stand-in"
    print(f"{name}; {args.layers} layers; warm {args.warm} tokens, timed {args.tokens}")
    print("| experts allowed in VRAM | policy | decode tok/s | device hit rate (timed tokens) | resident / "
          "capacity | promotions | prefill crossover (tokens per expert) |")
    print("|---|---|---|---|---|---|---|")
    tokens = {}
    for share in SHARES:
        for policy in ("decayed-frequency", "hit-threshold") if 0 < share < 1 else ("decayed-frequency",):
            r = decode_case(model, share, policy, args.warm, args.tokens, args.device)
            tokens[(share, policy)] = r["tokens"]
            print(f"| {share:.0%} | {policy} | {r['tok_s']:.1f} | {r['hit_rate']:.2f} | {r['resident']} / "
                  f"{r['capacity']} | {r['promotions']} | {r['crossover']:.1f} |", flush=True)
    first = next(iter(tokens.values()))
    same = sum(t == first for t in tokens.values())
    print(f"\ngreedy tokens identical across the {len(tokens)} cases: {same}/{len(tokens)}")


if __name__ == "__main__":
    main()
