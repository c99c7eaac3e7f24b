"""Where a decoded token's time goes, against the bytes it must read divided by the same-run bandwidth.

    python benchmarks/token_profile.py [--model bench-data/e2e-8l-q4] [--precision exact] [--backbone q4]

Times every leaf step of the token loop (projections by kind, norms, rotary, attention, KV store, router,
the expert executor split into native kernel, read wait and its Python side) by wrapping them, and reports
the rest (embedding, residual adds, sampling, the loop itself) as glue. The wrappers cost about a
microsecond a call, so the total is a little above an unwrapped run's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mosaic_runtime  # noqa: E402,F401  before torch: the OpenMP settings the engine runs with (README)
from benchmarks.peer_bench import bandwidth, mosaic_token_bytes, token_stream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "bench-data" / "e2e-8l-q4"))
    ap.add_argument("--precision", default="fast", choices=["fast", "exact"])
    ap.add_argument("--kernel", help="override the precision's expert kernel")
    ap.add_argument("--backbone", help="override the precision's backbone")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warm", type=int, default=96, help="tokens decoded before the timed ones")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--torch-path", action="store_true", help="decode through the torch ops, not the native layers")
    args = ap.parse_args()

    import torch

    from mosaic_runtime.engine import Engine
    from mosaic_runtime.experts import ExpertExecutor
    from mosaic_runtime.models import decoder as module
    engine = Engine.open(args.model, precision=args.precision, kernel=args.kernel, backbone=args.backbone,
                         threads=args.threads, max_seq=512)
    engine.finish_preload()  # a steady state: the fill's page faults and reads are not a token's cost
    model = engine.model
    spent: dict[str, float] = defaultdict(float)
    kinds = {id(model.weights.lm_head): "lm_head"}
    for layer in model.weights.layers:
        if layer.ffn.router is not None:
            kinds[id(layer.ffn.router)] = "router"

    def timed(name_of, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name_of(*a)] += time.perf_counter() - t
        return wrapper

    module.linear = timed(lambda x, w: kinds.get(id(w), "projections"), module.linear)
    module.rms_norm = timed(lambda *a: "norms", module.rms_norm)
    module.cached_attention = timed(lambda *a: "attention", module.cached_attention)
    module.swiglu = timed(lambda *a: "projections", module.swiglu)
    module.route = timed(lambda *a: "router", module.route)
    if model.rotary is not None:
        model.rotary.apply = timed(lambda *a: "rotary", model.rotary.apply)
    if model.state.kv is not None:
        model.state.kv.store = timed(lambda *a: "kv store", model.state.kv.store)
    if model.native is not None:  # the native decode step (decode_token.cpp)
        step = model.native.step_fn

        class TimedStep:
            run = staticmethod(timed(lambda *a: "native layer loop", step.run))
            mlp = staticmethod(timed(lambda *a: "native layer loop", step.mlp))  # a layer's shared expert
            top_k, vocab = step.top_k, step.vocab
        model.native.step_fn = TimedStep()
        if args.torch_path:
            model.use_native_decode = False
    experts = model.experts
    loop_kernel = [0.0]  # the experts' kernel time inside the native layer loop

    def loop_ran(layers, ids, kernel_s):
        loop_kernel[0] += kernel_s
        experts.ran_natively(layers, ids, kernel_s)

    class TimedExperts(ExpertExecutor):  # the engine also reads the executor's counters (kernel_s)
        __call__ = staticmethod(timed(lambda *a: "experts", experts))
        add_decode = staticmethod(timed(lambda *a: "experts", experts.add_decode))  # layers the step hands back
        native_loop = staticmethod(experts.native_loop)
        ran_natively = staticmethod(timed(lambda *a: "experts", loop_ran))

        @property
        def kernel_s(self):
            return experts.kernel_s

    model.experts = TimedExperts()

    # The peer benchmark's fixed pseudo-random stream, fed rather than sampled: routing varies from token
    # to token as with real text (a random model's greedy choice repeats one token and routes every step
    # alike). The warm tokens come first, so the experts the timed ones use are mostly in the ring.
    stream = token_stream("a", 32 + args.warm + args.tokens)
    prompt, warm, timed_ids = stream[:32], stream[32:32 + args.warm], stream[32 + args.warm:]
    model.forward(torch.tensor(prompt), 0)
    pos = len(prompt)
    for token in warm:
        model.forward(torch.tensor([token]), pos)
        pos += 1
    spent.clear()
    loop_kernel[0] = 0.0
    kernel0, io0 = experts.kernel_s, engine.store.io.io_s if engine.store else 0.0
    t0 = time.perf_counter()
    for token in timed_ids:
        model.forward(torch.tensor([token]), pos)
        pos += 1
    total = (time.perf_counter() - t0) / args.tokens
    per = {k: v / args.tokens for k, v in spent.items()}
    kernel = (experts.kernel_s - kernel0) / args.tokens
    io = ((engine.store.io.io_s if engine.store else 0.0) - io0) / args.tokens
    in_loop = loop_kernel[0] / args.tokens  # counted in "native layer loop", and in kernel
    rows = [(k, v) for k, v in per.items() if k not in ("experts", "native layer loop")]
    if "native layer loop" in per:
        rows.append(("native layer loop: attention blocks, routers, head", per["native layer loop"] - in_loop))
    rows += [("expert kernel (native)", kernel), ("expert read wait", io),
             ("experts: Python side", per.get("experts", 0.0) - (kernel - in_loop) - io)]
    rows.append(("glue (embedding, residuals, loop)", total - sum(per.values())))
    bw = bandwidth(args.threads or os.cpu_count() or 1)
    need = mosaic_token_bytes(engine)
    print(f"{args.model}: {', '.join(f'{k} {v}' for k, v in engine.settings.items())}; {args.tokens} decoded tokens")
    print("| step | ms per token | share |")
    print("|---|---|---|")
    for k, v in sorted(rows, key=lambda r: -r[1]):
        print(f"| {k} | {v * 1e3:.2f} | {v / total:.0%} |")
    print(f"| **total** | **{total * 1e3:.2f}** ({1 / total:.1f} tok/s) | |")
    floor = need / (bw * 1e9)
    huge = next((line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")), "?")
    print(f"\nanonymous memory on transparent huge pages: {int(huge) // 1024} MiB")
    print(f"bytes a token must read: {need / 1e6:.0f} MB; same-run bandwidth {bw:.1f} GB/s -> floor "
          f"{floor * 1e3:.2f} ms; token time / floor = {total / floor:.2f}")


if __name__ == "__main__":
    main()
