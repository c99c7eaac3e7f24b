"""Routing of real models: per-layer expert-usage skew, next-token expert reuse, the hit rate of
Mosaic's LRU ring (the engine's own LRUPolicy) against ring size, with a PNG plot, and the device
tier's promotion policies (mosaic_runtime.tier) against their budget.

    python benchmarks/routing_bench.py [--model examples/stdlib-moe] [--routing ../shared/routing]
                                       [--plot benchmarks/routing_lru.png]

Traces: the bundled model routed by Mosaic's own runtime over held-out standard-library text (windows of
256 tokens, teacher-forced: per token the same routing a decode step makes), and the public traces in
../shared/routing (DeepSeek-V2-Lite-Chat prefill, Mixtral-8x7B-Instruct decode). The public traces carry
no licence: they are read from there, never copied into this repository.

The ring is simulated exactly as ExpertStore drives it: per token, layer by layer, each layer's top-k are
looked up and the misses placed (LRU, never evicting the layer's own experts). The ring persists over all
sequences of a trace, as in one long-lived engine. Beside it: a static cache holding the most-used experts
of the whole trace (an oracle that knows the future), to show how far LRU is from the best fixed set.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from mosaic_runtime.cache.policy import LRUPolicy  # noqa: E402
from mosaic_runtime.tier import POLICIES  # noqa: E402

FRACTIONS = (0.05, 0.10, 0.25, 0.50, 1.00)


@dataclass
class Trace:
    name: str
    kind: str
    n_experts: int
    top_k: int
    sequences: list[np.ndarray]  # each [T, L, k] expert ids

    @property
    def layers(self) -> int:
        return self.sequences[0].shape[1]

    @property
    def tokens(self) -> int:
        return sum(s.shape[0] for s in self.sequences)


def bundled_trace(model: Path, windows: int = 40, seq: int = 256) -> Trace:
    """Route held-out text through the bundled model's Q4 vault with Mosaic's runtime."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_bundled import chat_turns, held_out, stdlib_files

    from mosaic_runtime.engine import Engine
    from mosaic_shatter.convert import convert

    class Recorder:
        def __init__(self, inner):
            self.inner, self.ids = inner, {}

        def __call__(self, layer, x, topk_weights, topk_ids):
            self.ids[layer] = topk_ids.clone()
            return self.inner(layer, x, topk_weights, topk_ids)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with tempfile.TemporaryDirectory() as tmp:
        out = convert(str(model), Path(tmp) / "q4", "q4", progress=False).out
        engine = Engine.open(out, max_seq=seq, precision="exact")
        docs = [d for rel, text in stdlib_files() if held_out(rel) for d in [text] + chat_turns(rel, text)]
        ids = [i for d in docs for i in engine.codec.encode(d)]
        recorder = Recorder(engine.model.experts)
        engine.model.experts = recorder
        sequences = []
        for w in range(min(windows, len(ids) // seq)):
            engine.logits(ids[w * seq:(w + 1) * seq])
            sequences.append(np.stack([recorder.ids[layer].numpy() for layer in sorted(recorder.ids)], axis=1))
        arch = engine.arch
        engine.close()
    return Trace("bundled stdlib-moe", "held-out text, teacher-forced", arch["num_experts"],
                 arch["num_experts_per_tok"], sequences)


def deepseek_trace(folder: Path) -> Trace:
    """DeepSeek-V2-Lite-Chat: per-file CSVs, rows grouped by layer (1..26), then token order."""
    sequences = []
    for path in sorted(folder.rglob("*.csv")):
        by_layer: dict[int, list[list[int]]] = {}
        with path.open(newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                by_layer.setdefault(int(row["Layer ID"]), []).append(json.loads(row["Activated Expert IDs"]))
        lengths = {len(v) for v in by_layer.values()}
        if len(by_layer) != 26 or len(lengths) != 1:
            continue  # an incomplete file
        sequences.append(np.array([by_layer[layer] for layer in sorted(by_layer)]).transpose(1, 0, 2))
    return Trace("DeepSeek-V2-Lite-Chat", "prompts, teacher-forced prefill", 64, 6, sequences)


def mixtral_trace(folder: Path) -> Trace:
    """Mixtral-8x7B-Instruct: decode tokens, one JSONL record per (problem, layer, token)."""
    rows: dict[tuple[str, int], dict[tuple[int, int], list[int]]] = {}
    for path in sorted(folder.glob("*_2_routing.jsonl")):
        for line in path.open(encoding="utf-8"):
            r = json.loads(line)
            rows.setdefault((r["dataset"], r["problem_id"]), {})[(r["token_idx"], r["layer"])] = r["experts"]
    sequences = []
    for cells in rows.values():
        n_tok = 1 + max(t for t, _ in cells)
        full = [t for t in range(n_tok) if all((t, layer) in cells for layer in range(32))]
        sequences.append(np.array([[cells[(t, layer)] for layer in range(32)] for t in full]))
    return Trace("Mixtral-8x7B-Instruct", "greedy decode", 8, 2, sequences)


def usage_skew(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Per layer: share of selections taken by the most-used 10 % of experts, and normalised entropy."""
    counts = np.zeros((trace.layers, trace.n_experts))
    for s in trace.sequences:
        for layer in range(trace.layers):
            counts[layer] += np.bincount(s[:, layer].ravel(), minlength=trace.n_experts)
    share = counts / counts.sum(1, keepdims=True)
    top = max(1, round(0.1 * trace.n_experts))
    top_share = np.sort(share, 1)[:, ::-1][:, :top].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(np.where(share > 0, share * np.log(share), 0), 1) / np.log(trace.n_experts)
    return top_share, entropy


def next_token_reuse(trace: Trace) -> np.ndarray:
    """Per layer: mean |E_t & E_t-1| / k over consecutive tokens."""
    total, n = np.zeros(trace.layers), 0
    for s in trace.sequences:
        for t in range(1, s.shape[0]):
            total += [len(set(s[t, layer]) & set(s[t - 1, layer])) for layer in range(trace.layers)]
            n += 1
    return total / (n * trace.top_k)


def lru_hit_rate(trace: Trace, slots: int) -> tuple[float, np.ndarray]:
    """(overall, per layer) hit rate of the engine's LRUPolicy with `slots` records."""
    policy = LRUPolicy(slots)
    for s in trace.sequences:
        for t in range(s.shape[0]):
            for layer in range(trace.layers):
                pinned = set()
                for e in sorted(set(s[t, layer].tolist())):
                    slot = policy.lookup((layer, e))
                    if slot is None:
                        slot = policy.place((layer, e), pinned)
                    pinned.add(slot)
    return hit_rates(policy.counters, trace.layers)


def hit_rates(counters: dict, layers: int) -> tuple[float, np.ndarray]:
    """(overall, per layer) hit rate from per-layer counters with `hits` and `misses`."""
    per_layer = np.array([counters[i].hits / max(1, counters[i].hits + counters[i].misses) for i in range(layers)])
    hits = sum(v.hits for v in counters.values())
    return hits / sum(v.hits + v.misses for v in counters.values()), per_layer


def tier_hit_rate(trace: Trace, policy_name: str, slots: int) -> tuple[float, np.ndarray, float]:
    """(overall hit rate, per-layer hit rates, promotions per token) of a device-tier policy holding
    `slots` records, over the trace as one stream."""
    policy = POLICIES[policy_name](budget_bytes=slots, record_bytes=1)
    for s in trace.sequences:
        for t in range(s.shape[0]):
            for layer in range(trace.layers):
                policy.access(layer, sorted(set(s[t, layer].tolist())))
    overall, per_layer = hit_rates(policy.counters, trace.layers)
    return overall, per_layer, sum(v.promotions for v in policy.counters.values()) / trace.tokens


def static_oracle_hit_rate(trace: Trace, slots: int) -> float:
    """Hit rate of a fixed cache of the `slots` most-used (layer, expert) pairs of the whole trace."""
    counts = Counter()
    for s in trace.sequences:
        for layer in range(trace.layers):
            ids, n = np.unique(s[:, layer], return_counts=True)
            for e, c in zip(ids.tolist(), n.tolist()):
                counts[(layer, e)] += c
    total = sum(counts.values())
    return sum(c for _, c in counts.most_common(slots)) / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--routing", type=Path, default=ROOT.parent / "shared" / "routing")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "routing_lru.png")
    args = ap.parse_args()
    traces = [bundled_trace(args.model)]
    if (args.routing / "deepseek-v2-lite").is_dir():
        traces.append(deepseek_trace(args.routing / "deepseek-v2-lite"))
    if (args.routing / "mixtral-8x7b").is_dir():
        traces.append(mixtral_trace(args.routing / "mixtral-8x7b"))

    print("| model | routing | layers x experts, top-k | tokens | top-10 % experts' share (uniform 0.10) "
          "| normalised entropy | next-token reuse (random k/E) |")
    print("|---|---|---|---|---|---|---|")
    for tr in traces:
        share, ent = usage_skew(tr)
        reuse = next_token_reuse(tr)
        print(f"| {tr.name} | {tr.kind} | {tr.layers} x {tr.n_experts}, top-{tr.top_k} | {tr.tokens:,} | "
              f"{share.mean():.2f} ({share.min():.2f}-{share.max():.2f}) | {ent.mean():.2f} ({ent.min():.2f}-{ent.max():.2f}) | "
              f"{reuse.mean():.2f} ({reuse.min():.2f}-{reuse.max():.2f}); random {tr.top_k / tr.n_experts:.2f} |")

    print("\n| model | ring (share of all experts) | slots | LRU hit rate | per-layer range | static oracle |")
    print("|---|---|---|---|---|---|")
    curves = {}
    for tr in traces:
        total = tr.layers * tr.n_experts
        xs, lru, oracle = [], [], []
        for f in FRACTIONS:
            slots = max(tr.top_k, round(f * total))
            hit, per_layer = lru_hit_rate(tr, slots)
            best = static_oracle_hit_rate(tr, slots)
            xs.append(slots / total)
            lru.append(hit)
            oracle.append(best)
            print(f"| {tr.name} | {slots / total:.0%} | {slots} | {hit:.3f} | {per_layer.min():.2f}-{per_layer.max():.2f} "
                  f"| {best:.3f} |")
        curves[tr.name] = (xs, lru, oracle)

    print("\n| model | device tier (share of all experts) | policy | hit rate | per-layer range | promotions per token |")
    print("|---|---|---|---|---|---|")
    for tr in traces:
        total = tr.layers * tr.n_experts
        for f in (0.05, 0.10, 0.25):
            slots = max(1, round(f * total))
            for name in POLICIES:
                hit, per_layer, promos = tier_hit_rate(tr, name, slots)
                print(f"| {tr.name} | {f:.0%} ({slots}) | {name} | {hit:.3f} | {per_layer.min():.2f}-{per_layer.max():.2f} "
                      f"| {promos:.2f} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for name, (xs, lru, oracle) in curves.items():
        line, = ax.plot(xs, lru, marker="o", label=f"{name}: LRU ring")
        ax.plot(xs, oracle, linestyle="--", color=line.get_color(), label=f"{name}: static oracle")
    ax.set_xscale("log")
    ax.set_xlabel("ring size (share of all routed experts)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Expert cache hit rate against ring size")
    fig.tight_layout()
    fig.savefig(args.plot)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
