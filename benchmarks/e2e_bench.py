"""End to end: decode tok/s and TTFT on a random-weight Qwen3-MoE with Qwen3-30B-A3B's per-layer geometry
(hidden 2048, 128 experts, top-8, moe_intermediate 768), 8 layers, Q4 vault; (a) everything fitting in
RAM, (b) under a cgroup v1 memory limit of half the vault size (FACTS.md §3 recipe); Direct vs buffered.

    python benchmarks/e2e_bench.py [--layers 8] [--tokens 24]

Each case runs in a fresh process after the page cache is dropped: TTFT is cold (prompt of 32 tokens),
decode tok/s is over the following tokens. Bytes read per token are compared to the model's active-expert
bytes (layers x top-8 x record size).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import mosaic_runtime  # noqa: E402,F401  before torch: the OpenMP settings the engine runs with (README)
from benchmarks.convert_bench import build_checkpoint, drop_caches, peak_rss  # noqa: E402
from benchmarks.memlimit import run_worker  # noqa: E402

PROMPT = [(17 * i + 5) % 8192 for i in range(32)]


def worker(model: str, io: str, ram_budget: int | None, tokens: int, backbone: str = "bf16") -> None:
    from mosaic_runtime.engine import Engine
    engine = Engine.open(model, ram_budget=ram_budget, io=io, max_seq=256, precision="exact", backbone=backbone)
    out = list(engine.generate_ids(PROMPT, max_new_tokens=tokens))
    s = engine.stats
    rec = engine.vault.header.record_bytes
    moe_layers = len(engine.vault.moe_layers)
    print(json.dumps({
        "tokens": len(out), "ttft_s": s.ttft_s, "tok_per_s": s.tok_per_s, "hit_rate": s.hit_rate,
        "ring_slots": engine.store.ring.n_slots, "records": engine.vault.header.num_records,
        "bytes_read_per_token": s.bytes_read / (len(PROMPT) + len(out)),
        "active_expert_bytes": moe_layers * engine.arch["num_experts_per_tok"] * rec,
        "io_s": s.io_s, "kernel_s": s.kernel_s, "backbone_s": s.backbone_s,
        "io_mode": engine.store.ring.mode, "peak_rss": peak_rss(),
    }))


def run_case(model: Path, io: str, ram_budget: int | None, tokens: int, limit: int | None) -> dict:
    drop_caches()
    cmd = [sys.executable, __file__, "--worker", str(model), "--io", io, "--tokens", str(tokens)]
    if ram_budget is not None:
        cmd += ["--ram-budget", str(ram_budget)]
    return run_worker(cmd, limit)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--worker")
    ap.add_argument("--io", default="buffered")
    ap.add_argument("--ram-budget", type=int)
    ap.add_argument("--backbone", default="bf16", choices=["bf16", "int8", "fp8", "q4"])
    ap.add_argument("--engine-bytes", type=int, default=850 << 20,
                    help="case (b): memory the engine needs besides the ring (backbone, torch, KV cache)")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.io, args.ram_budget, args.tokens, args.backbone)

    data = ROOT / "bench-data"
    ckpt = build_checkpoint(data / f"qwen3-30b-geometry-{args.layers}l", args.layers)
    model = data / f"e2e-{args.layers}l-q4"
    if not (model / "experts.vault").exists():
        from mosaic_shatter.convert import convert
        convert(str(ckpt), model, "q4", progress=False, force=True)
    vault_bytes = (model / "experts.vault").stat().st_size
    # Under the limit the ring gets what the engine itself (bf16 backbone, KV cache, Python and torch) leaves;
    # MemAvailable does not see a cgroup, so the ring budget is passed explicitly.
    limit = vault_bytes // 2
    ring_under_limit = limit - args.engine_bytes
    print(f"vault {vault_bytes / 1e9:.2f} GB; cgroup limit {limit / 1e9:.2f} GB; ring under the limit "
          f"{ring_under_limit / 1e9:.2f} GB")
    print("| case | io | cold TTFT s | decode tok/s | ring slots / records | hit rate | "
          "MB read per token | active expert MB per token | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, budget, lim in (("(a) fits in RAM", None, None), ("(b) cgroup limit 1/2 vault", ring_under_limit, limit)):
        for io in ("direct", "buffered"):
            r = run_case(model, io, budget, args.tokens, lim)
            print(f"| {case} | {r['io_mode']} | {r['ttft_s']:.2f} | {r['tok_per_s']:.2f} | {r['ring_slots']} / "
                  f"{r['records']} | {r['hit_rate']:.2f} | {r['bytes_read_per_token'] / 1e6:.1f} | "
                  f"{r['active_expert_bytes'] / 1e6:.1f} | {r['peak_rss'] / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
