"""Experts at their own precision on the bundled model: held-out perplexity against the bytes a token reads.

The routing is counted with `mosaic_runtime.calibrate` on calibration text (training-side standard-library
files, disjoint from the held-out ones), then the bundled checkpoint is converted with each layer's cold
tail stored as Q3_G32 or Q2_G32 at several hot masses, beside uniform Q4, Q3 and Q2 vaults. Each vault is
scored on the same held-out windows as quality_bench.py. "Bytes a token reads" is what the routing of the
held-out text asks for: with no record cached (the records' stored lengths, summed over each token's
selections), and through a ring of 25 % and 50 % of the records driven by the engine's routing policy
(benchmarks/traces.py, token by token as ExpertStore drives it, read-ahead included): the I/O a model
pays per token when it does not fit. The hot experts are the ones a ring keeps, so its misses fall on the
cold tail, which is where the low-bit records save.

    python benchmarks/mixed_precision_bench.py [--windows 40] [--calibration-tokens 20000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from quality_bench import score, windows  # noqa: E402
from routing_bench import bundled_trace  # noqa: E402
from traces import ring_hit_rate  # noqa: E402
from train_bundled import SEQ, chat_turns, held_out, stdlib_files  # noqa: E402

from mosaic_runtime.cache.policy import RoutingPolicy  # noqa: E402
from mosaic_runtime.calibrate import routing_counts, write_routing  # noqa: E402
from mosaic_runtime.engine import Engine  # noqa: E402
from mosaic_shatter.convert import convert  # noqa: E402
from mosaic_shatter.precision import MixedPrecision  # noqa: E402


def calibration_ids(engine, tokens: int) -> list[int]:
    """Training-side text (never a held-out file), the first `tokens` tokens of it."""
    ids: list[int] = []
    for rel, text in stdlib_files():
        if not held_out(rel):
            for doc in [text] + chat_turns(rel, text):
                ids += engine.codec.encode(doc)
        if len(ids) >= tokens:
            break
    return ids[:tokens]


RING_SHARES = (0.25, 0.5)


def bytes_per_token(engine, trace) -> list[float]:
    """Stored bytes a token reads on the held-out trace: with nothing cached (every selected record), then
    through rings of RING_SHARES of the records."""
    vault = engine.vault
    sizes = np.array([[vault.entry(layer, e).length for e in range(trace.n_experts)] for layer in vault.moe_layers])
    rows = np.arange(trace.layers)[:, None]
    out = [sum(int(sizes[rows, s].sum()) for s in trace.sequences) / trace.tokens_total]  # s: [T, L, k] ids
    for share in RING_SHARES:
        policy = RoutingPolicy(round(share * sizes.size), list(range(trace.layers)), trace.n_experts, trace.top_k)
        out.append(ring_hit_rate(policy, trace, sizes).bytes_per_token)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--calibration-tokens", type=int, default=20000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    wins = windows(args.model, args.windows)
    trace, _ = bundled_trace(args.model, args.windows)  # the held-out windows' routing, for the I/O
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        uniform = convert(str(args.model), tmp / "q4", "q4", progress=False).out
        with Engine.open(uniform, max_seq=SEQ, precision="exact") as engine:
            calib = calibration_ids(engine, args.calibration_tokens)
            write_routing(tmp / "routing.json", engine, routing_counts(engine, calib, SEQ), len(calib), ["stdlib"])
        variants = [("uniform Q4", None)]
        for cold in ("q3", "q2"):
            variants += [(f"Q4 for {m:.0%} of the routing, {cold.upper()} tail", (cold, m)) for m in (0.9, 0.8, 0.6)]
            variants.append((f"uniform {cold.upper()}", (cold, 0.0)))
        for name, mixed in variants:
            out = tmp / name.replace(" ", "_").replace("%", "").replace(",", "")
            if mixed is None:
                out = uniform
            else:
                convert(str(args.model), out, "q4", progress=False,
                        mixed=MixedPrecision.of(tmp / "routing.json", mixed[0], mixed[1]))
            result = [name]
            for precision in ("exact", "fast"):
                with Engine.open(out, max_seq=SEQ, precision=precision) as engine:
                    ppl, _ = score(engine.logits, wins)
                    result.append(ppl)
                    if precision == "exact":
                        cold, *ring = bytes_per_token(engine, trace)
                        result += [cold, ring, (out / "experts.vault").stat().st_size, engine.vault.record_quants]
            rows.append(result)
    base_ppl, base_cold, base_ring = rows[0][1], rows[0][2], rows[0][3]
    print(f"calibration: {len(calib):,} training-side tokens; held out: {len(wins)} windows of {SEQ} tokens\n")
    rings = " | ".join(f"KiB a token, ring {s:.0%} (vs Q4)" for s in RING_SHARES)
    print(f"| vault | records (Q4 / Q3 / Q2) | vault MiB | KiB a token, nothing cached (vs Q4) | {rings} | "
          "perplexity, exact | vs Q4 | perplexity, fast default |")
    print("|---|---|---|---|" + "---|" * len(RING_SHARES) + "---|---|---|")
    for name, ppl_exact, cold, ring, size, quants, ppl_fast in rows:
        mix = " / ".join(str(quants.get(q, 0)) for q in ("Q4_G32", "Q3_G32", "Q2_G32"))
        ring_cells = " | ".join(f"{b / 1024:.0f} ({b / b0:.2f})" for b, b0 in zip(ring, base_ring))
        print(f"| {name} | {mix} | {size / 2**20:.2f} | {cold / 1024:.0f} ({cold / base_cold:.2f}) | {ring_cells} | "
              f"{ppl_exact:.3f} | {ppl_exact / base_ppl - 1:+.2%} | {ppl_fast:.3f} |")


if __name__ == "__main__":
    main()
