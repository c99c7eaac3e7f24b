"""Decode and prefill speed of a hybrid model against context length: 100, 1k, 8k and 32k tokens.

    python benchmarks/hybrid_context_bench.py [--layers 4] [--experts 32] [--prefill-max 8192]

Model: random weights with Qwen3.5-35B-A3B's per-layer geometry (hidden 2048; Gated DeltaNet with 16 key /
32 value heads of 128, conv 4; gated attention with 16 query / 2 KV heads of 256, partial RoPE; experts of
512, top-8, a shared expert of 512), `--layers` layers in the real 3:1 order (3 DeltaNet, 1 full
attention), and fewer routed experts per layer than the real 256 (the cost per token depends on top-k,
not on the expert count). Vocabulary 8192. Q4 vault, all experts in the ring.

Decode: one engine per length holds its context; their decode steps are interleaved one by one (--steps
per length, medians), so the machine's drift falls on every length alike. The context is prefilled for real up to
--prefill-max tokens (prefill tok/s reported); beyond it the KV cache and the DeltaNet states are filled
with random values of the right size instead, since a decode step's cost depends on how much it reads,
not on what. Memory: the KV pages in use and the DeltaNet states.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import mosaic_runtime  # noqa: E402,F401  before torch: the OpenMP settings the engine runs with (README)
import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from builders import tiny_hybrid  # noqa: E402

from mosaic_runtime.engine import Engine  # noqa: E402
from mosaic_shatter.convert import convert  # noqa: E402

LENGTHS = (100, 1_000, 8_000, 32_000)
PREFILL_CHUNK = 256  # tokens per forward call: bounds the attention scores' memory
GEOMETRY = dict(vocab_size=8192, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts_per_tok=8)


def build(root: Path, layers: int, experts: int) -> Path:
    out = root / f"qwen35-geometry-{layers}l-{experts}e-q4"
    if not (out / "experts.vault").exists():
        ckpt = tiny_hybrid("qwen3_5_moe", root / f"qwen35-geometry-{layers}l-{experts}e", dtype=torch.bfloat16,
                           num_hidden_layers=layers, num_experts=experts, **GEOMETRY)
        convert(str(ckpt), out, "q4", progress=False)
    return out


def fill(engine, length: int, prefill_max: int, gen: torch.Generator) -> float | None:
    """Bring the model's state to `length` tokens; prefill tok/s when it was prefilled for real."""
    model = engine.model
    model.state.reset()
    if length <= prefill_max:
        ids = torch.randint(0, 8192, (length,), generator=gen)
        t = time.perf_counter()
        for start in range(0, length, PREFILL_CHUNK):
            model.forward(ids[start:start + PREFILL_CHUNK], start)
        return length / (time.perf_counter() - t)
    kv = model.state.kv
    heads, dim = kv.k.shape[1], kv.k.shape[4]
    for layer in range(kv.k.shape[0]):
        kv.store(layer, 0, torch.randn(length, heads, dim, generator=gen) * 0.1,
                 torch.randn(length, heads, dim, generator=gen))
    model.state.conv.normal_(generator=gen)
    model.state.recurrent.normal_(generator=gen).mul_(0.01)
    model.state.length = length
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--prefill-max", type=int, default=8_192)
    ap.add_argument("--steps", type=int, default=48, help="decode steps timed per length")
    ap.add_argument("--kv", default="float32", choices=["float32", "bfloat16", "int8"], help="the KV cache's dtype")
    args = ap.parse_args()
    vault = build(ROOT / "bench-data", args.layers, args.experts)
    gen = torch.Generator().manual_seed(0)
    # One engine per length, each holding its context, so the lengths' decode steps can be interleaved one
    # by one: this VM's bandwidth drifts by a third within a minute, which would otherwise land on whichever
    # length ran at the time. The KV pools are mapped lazily, so the short contexts cost little memory.
    engines, prefills = {}, {}
    for length in LENGTHS:
        engine = Engine.open(vault, max_seq=max(LENGTHS) + args.steps + 8, kv_dtype=args.kv)
        engine.finish_preload()
        prefills[length] = fill(engine, length, args.prefill_max, gen)
        engines[length] = engine
    tokens = {length: torch.tensor([1]) for length in LENGTHS}

    def step(length: int) -> float:
        model = engines[length].model
        t = time.perf_counter()
        logits = model.forward(tokens[length], model.state.length)
        elapsed = time.perf_counter() - t
        tokens[length] = logits[-1:].argmax(-1)
        return elapsed

    for length in LENGTHS:  # warm-up: first touch of the experts' records and the KV pages
        step(length)
    times: dict[int, list[float]] = {n: [] for n in LENGTHS}
    for _ in range(args.steps):
        for length in LENGTHS:
            times[length].append(step(length))
    base = 1 / statistics.median(times[LENGTHS[0]])
    some = engines[LENGTHS[0]]
    page_bytes = some.model.state.kv.page_bytes
    print(f"{args.layers} layers ({some.arch['layer_types'].count('linear_attention')} DeltaNet, "
          f"{some.arch['layer_types'].count('full_attention')} full attention), {args.experts} experts, "
          f"KV cache {args.kv}, DeltaNet state {some.model.state.state_bytes / 2**20:.1f} MiB (constant), "
          f"{args.steps} steps per length, interleaved one by one\n")
    print("| context tokens | decode tok/s | vs 100 tokens | prefill tok/s | KV cache in use |")
    print("|---|---|---|---|---|")
    for length in LENGTHS:
        tps = 1 / statistics.median(times[length])
        pf = f"{prefills[length]:.1f}" if prefills[length] else "(filled, not timed)"
        kv_bytes = engines[length].model.state.kv.pages_in_use * page_bytes
        print(f"| {length:,} | {tps:.2f} | {tps / base:.2f} | {pf} | {kv_bytes / 2**20:.1f} MiB |")


if __name__ == "__main__":
    main()
