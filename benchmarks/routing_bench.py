"""Routing of real models: per-layer expert-usage skew, next-token expert reuse, the hit rate of the
ring's policies (the engine's RoutingPolicy, with its read-ahead, and LRU; on the bundled model also the
routing policy reading ahead with the router lookahead's guesses) against ring size beside the Belady
bound, with a PNG plot, and the device tier's promotion policies (mosaic_runtime.tier) against their
budget.

    python benchmarks/routing_bench.py [--model examples/stdlib-moe] [--routing ../shared/routing]
                                       [--plot benchmarks/routing_ring.png]

Traces: the bundled model routed by Mosaic's own runtime over held-out standard-library text (windows of
256 tokens, teacher-forced: per token the same routing a decode step makes), and the public traces in
../shared/routing (DeepSeek-V2-Lite-Chat prefill, Mixtral-8x7B-Instruct decode). The public traces carry
no licence: they are read from there, never copied into this repository.

The ring is simulated exactly as ExpertStore drives it (benchmarks/traces.py: ring_hit_rate): per token,
layer by layer, each layer's top-k are looked up, the misses placed (never evicting the layer's own
experts), and the next layer read ahead where the policy says so. The ring persists over all sequences of
a trace, as in one long-lived engine. Beside it: the Belady bound (a demand-read ring that evicts what is
used farthest ahead) and a static cache of the most-used experts of the whole trace (both know the future).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.traces import Trace, belady_hit_rate, deepseek_trace, mixtral_trace, ring_hit_rate  # noqa: E402
from mosaic_runtime.cache.policy import LRUPolicy, RoutingPolicy  # noqa: E402
from mosaic_runtime.tier import POLICIES  # noqa: E402

FRACTIONS = (0.05, 0.10, 0.25, 0.50, 1.00)


def bundled_trace(model: Path, windows: int = 40, seq: int = 256) -> tuple[Trace, float]:
    """Route held-out text through the bundled model's Q4 vault with Mosaic's runtime, with the router
    lookahead's guess at each layer's experts (models/lookahead.py: layer l+1's router applied to layer l's
    FFN input, re-normed with l+1's norm weight, the guess the decode step makes while layer l computes).
    Also returns the mean share of a layer's top-k that the guess names."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_bundled import chat_turns, held_out, stdlib_files

    from mosaic_runtime.engine import Engine
    from mosaic_runtime.models.lookahead import RouterLookahead
    from mosaic_shatter.convert import convert

    class Recorder:
        def __init__(self, inner):
            self.inner, self.ids, self.x = inner, {}, {}

        def __call__(self, layer, x, topk_weights, topk_ids):
            self.ids[layer], self.x[layer] = topk_ids.clone(), x.clone()
            return self.inner(layer, x, topk_weights, topk_ids)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    with tempfile.TemporaryDirectory() as tmp:
        out = convert(str(model), Path(tmp) / "q4", "q4", progress=False).out
        engine = Engine.open(out, max_seq=seq, precision="exact")
        lookahead = RouterLookahead(engine.model)
        docs = [d for rel, text in stdlib_files() if held_out(rel) for d in [text] + chat_turns(rel, text)]
        ids = [i for d in docs for i in engine.codec.encode(d)]
        recorder = Recorder(engine.model.experts)
        engine.model.experts = recorder
        sequences, guesses, tokens, overlap = [], [], [], []
        for w in range(min(windows, len(ids) // seq)):
            engine.logits(ids[w * seq:(w + 1) * seq])
            moe = sorted(recorder.ids)
            routes = np.stack([recorder.ids[layer].numpy() for layer in moe], axis=1)  # [T, L, k]
            guess = np.full_like(routes, -1)
            for i, a in enumerate(moe[:-1]):
                guess[:, i + 1] = lookahead.guesses(a, recorder.x[a].float()).numpy()
                overlap.append((guess[:, i + 1, :, None] == routes[:, i + 1, None, :]).any(-1).mean())
            sequences.append(routes)
            guesses.append(guess)
            tokens.append(ids[w * seq:(w + 1) * seq])
        arch = engine.arch
        engine.close()
    return Trace("bundled stdlib-moe", "held-out text, teacher-forced", arch["num_experts"],
                 arch["num_experts_per_tok"], sequences, tokens, guesses), float(np.mean(overlap))


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


def ring_policies(trace: Trace, slots: int):
    """(RingRun, per-layer hit rates) of LRU, of the routing policy on its statistics alone, and of the
    routing policy with the trace's router lookahead guesses (None for a trace without them), each driven
    over the trace as ExpertStore drives the engine's policy."""
    def routing():
        return RoutingPolicy(slots, list(range(trace.layers)), trace.n_experts, trace.top_k)
    out = []
    for policy, lookahead in ((LRUPolicy(slots), False), (routing(), False), (routing(), True)):
        if lookahead and not trace.guesses:
            out.append(None)
            continue
        run = ring_hit_rate(policy, trace, lookahead=lookahead)
        out.append((run, hit_rates(policy.counters, trace.layers)[1]))
    return out


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
    return overall, per_layer, sum(v.promotions for v in policy.counters.values()) / trace.tokens_total


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


def _range(v: np.ndarray) -> str:
    return f"{v.min():.2f}-{v.max():.2f}"


def _spread(v: np.ndarray) -> str:
    return f"{v.mean():.2f} ({_range(v)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "examples" / "stdlib-moe")
    ap.add_argument("--routing", type=Path, default=ROOT.parent / "shared" / "routing")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "routing_ring.png")
    args = ap.parse_args()
    if importlib.util.find_spec("matplotlib") is None:  # said now, not after the simulations
        ap.error("the plot needs matplotlib: pip install -e '.[bench]'")
    bundled, guess = bundled_trace(args.model)
    traces = [bundled]
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
        print(f"| {tr.name} | {tr.kind} | {tr.layers} x {tr.n_experts}, top-{tr.top_k} | {tr.tokens_total:,} | "
              f"{_spread(share)} | {_spread(ent)} | {_spread(reuse)}; random {tr.top_k / tr.n_experts:.2f} |")

    print(f"\nbundled model: layer l+1's router on layer l's FFN input names {guess:.2f} of layer l+1's top-"
          f"{bundled.top_k} (teacher-forced held-out text)")
    print("\n| model | ring (share of all experts) | slots | LRU hit rate (per-layer range) | routing policy hit rate "
          "(per-layer range) | records read per token, LRU / routing (of which read ahead; share used) "
          "| with the router lookahead: hit rate, records read (read ahead; share used) | Belady bound "
          "| static oracle |")
    print("|---|---|---|---|---|---|---|---|---|")
    curves = {}
    for tr in traces:
        total = tr.layers * tr.n_experts
        xs, lru, ours, belady = [], [], [], []
        for f in FRACTIONS:
            slots = max(tr.top_k, round(f * total))
            (base, per_layer), (run, ours_layer), guided = ring_policies(tr, slots)
            hit, lru_reads = base.hit_rate, base.reads_per_token
            static = static_oracle_hit_rate(tr, slots)
            with_guess = "-" if guided is None else (
                f"{guided[0].hit_rate:.3f}, {guided[0].reads_per_token:.1f} ({guided[0].ahead_per_token:.1f}; "
                f"{guided[0].ahead_used:.2f})")
            xs.append(slots / total)
            lru.append(hit)
            ours.append(run.hit_rate)
            belady.append(belady_hit_rate(tr, slots))
            print(f"| {tr.name} | {slots / total:.0%} | {slots} | {hit:.3f} ({_range(per_layer)}) "
                  f"| {run.hit_rate:.3f} ({_range(ours_layer)}) | {lru_reads:.1f} / "
                  f"{run.reads_per_token:.1f} ({run.ahead_per_token:.1f}; {run.ahead_used:.2f}) | {with_guess} "
                  f"| {belady[-1]:.3f} | {static:.3f} |", flush=True)
        curves[tr.name] = (xs, lru, ours, belady)

    print("\n| model | device tier (share of all experts) | policy | hit rate | per-layer range "
          "| promotions per token |")
    print("|---|---|---|---|---|---|")
    for tr in traces:
        total = tr.layers * tr.n_experts
        for f in (0.05, 0.10, 0.25):
            slots = max(1, round(f * total))
            for name in POLICIES:
                hit, per_layer, promos = tier_hit_rate(tr, name, slots)
                print(f"| {tr.name} | {f:.0%} ({slots}) | {name} | {hit:.3f} | {_range(per_layer)} | {promos:.2f} |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for name, (xs, lru, ours, belady) in curves.items():
        line, = ax.plot(xs, ours, marker="o", label=f"{name}: routing policy")
        ax.plot(xs, lru, marker=".", linestyle=":", color=line.get_color(), label=f"{name}: LRU")
        ax.plot(xs, belady, linestyle="--", color=line.get_color(), label=f"{name}: Belady bound")
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
