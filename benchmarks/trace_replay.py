"""Real routing at real geometry: the engine decodes a traced model's tokens with the router's choice
replaced by the trace's, token by token, under a memory limit.

    python benchmarks/trace_replay.py --trace deepseek-v2-lite [--limit-fraction 0.25 ...] [--tokens 200]
                                      [--routing ../shared/routing] [--work bench-data/replay] [--json]
                                      [--plot benchmarks/trace_replay.png] [--guess-precision P]

--trace names a trace under --routing (deepseek-v2-lite, mixtral-8x7b) or is its directory.

The vault has the traced model's expert geometry (hidden size, expert size, expert count, top-k, layer
count) in a supported family (DeepSeek-V2-Lite: Qwen2-MoE with a gated shared expert of the size of its two;
Mixtral-8x7B: Mixtral) and random weights: the disk and the memory do not care. It is built once under
--work: a checkpoint whose backbone is random and whose experts are sparse holes is converted, then every
record is rewritten with random Q4 codes (so that a wrong expert would change the logits).

Each run is a fresh process, page cache dropped first, in a cgroup v1 memory limit: the ring gets
`fraction` of the vault (ram_budget), the limit is that plus what the engine needs besides (backbone,
KV cache, torch), so the page cache cannot hold the rest of the vault. Reads are Direct I/O, so the ring
is the only cache. The routing override (NativeExperts.replay_routing) is a benchmark facility; nothing
else on the decode path changes, read-ahead and the ring policy included. With --guess-precision the
read-ahead also takes a synthetic router lookahead's guess at the recorded routing (ReplayLookahead).

Printed per run (one JSON line): tok_per_s, hit_rate, bytes_read_per_token, disk_busy_share (the share of
the run during which at least one read was in progress) and busy_gbps (the bytes over that time: the
disk's own rate while the engine kept it busy), disk_gbps (the median of --probes short reads made
during the run, the decode paused: about PROBE_BYTES of random records of the same vault through a ring
like the engine's with its queue kept full, no compute; the disk's speed drifts within minutes, so the
probes meet the disk the engine met), disk_probes_gbps (every record read once the same way right before
and right after the run), io_floor_tok_per_s (disk_gbps over the bytes read per token: what the reads
alone allow), read-ahead counts, the Belady hit-rate bound for the same ring over the same tokens, and a
hash of every logit (the same at every budget: memory buys speed, never quality).
The traces are read from ../shared/routing, never copied here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import mosaic_runtime  # noqa: E402,F401  before torch: the OpenMP settings the engine runs with (README)
from benchmarks.convert_bench import drop_caches  # noqa: E402
from benchmarks.geometries import VOCAB  # noqa: E402
from benchmarks.memlimit import run_worker  # noqa: E402
from benchmarks.reader_bench import probe_ring, stream_all  # noqa: E402
from benchmarks.traces import Trace, belady_hit_rate, load  # noqa: E402

GEOMETRIES = {
    # DeepSeek-V2-Lite: 26 MoE layers of 64 experts of 1408, top-6, two shared experts of 1408 (one of 2816
    # here, gated), 16 heads of 128 (its MLA reads about what this attention reads)
    "deepseek-v2-lite": {
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 2816, "intermediate_size": 10944,
        "num_experts": 64, "num_experts_per_tok": 6, "num_hidden_layers": 26, "num_attention_heads": 16,
        "num_key_value_heads": 16, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    # Mixtral-8x7B: 32 layers of 8 experts of 14336, top-2
    "mixtral-8x7b": {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 1e6, "rms_norm_eps": 1e-5},
}
PROBE_BYTES = 512 << 20  # a disk probe during the run: long enough to be steady, short beside the run
ENGINE_HEADROOM = 2560 << 20  # the limit beyond the ring: backbone, KV cache, torch, the margin
MAX_SEQ = 512  # sequences longer than this are left out of the replay


# --------------------------------------------------------------------------------------------- the vault
def build_vault(name: str, work: Path) -> Path:
    """The replay model directory for trace `name` (built once)."""
    out = work / f"{name}-q4"
    if (out / "experts.vault").exists():
        return out
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from builders import decoder_tensors, write_sparse_safetensors

    from mosaic_shatter.convert import convert

    cfg = dict(GEOMETRIES[name], vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False,
               hidden_act="silu", torch_dtype="bfloat16")
    ckpt = work / f"{name}-ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    tensors = decoder_tensors(cfg)
    experts = [t for t in tensors if ".experts." in t[0]]
    g = torch.Generator().manual_seed(0)
    backbone = {}
    for tensor, _, shape in tensors:
        if ".experts." not in tensor:
            t = torch.ones(*shape) if len(shape) == 1 else torch.randn(*shape, generator=g) * 0.02
            backbone[tensor] = t.to(torch.bfloat16)
    save_file(backbone, ckpt / "backbone.safetensors", metadata={"format": "pt"})
    weight_map = dict.fromkeys(backbone, "backbone.safetensors")
    for i in range(0, len(experts), 1024):  # the experts: a header, then holes
        file = f"experts-{i // 1024:05d}.safetensors"
        write_sparse_safetensors(ckpt / file, experts[i:i + 1024])
        weight_map.update({t[0]: file for t in experts[i:i + 1024]})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    staged = work / f".{name}-q4.randomising"  # out appears only once every record is random
    shutil.rmtree(staged, ignore_errors=True)
    convert(str(ckpt), staged, "q4", progress=True)
    shutil.rmtree(ckpt)
    randomise_records(staged)
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)
    return out


def randomise_records(model: Path) -> None:
    """Rewrite every record of the vault in place with random Q4 codes and small random scales."""
    import torch

    from mosaic_runtime.vault.format import PROJECTIONS
    from mosaic_runtime.vault.reader import Vault
    from mosaic_runtime.vault.record import SCALE_TORCH_DTYPES, pack_record
    from mosaic_shatter.write_vault import VaultWriter

    with Vault(model) as v:
        header, layout = v.header, v.layout
        keys = sorted(v.entries, key=lambda k: v.entries[k].offset)
        arch = v._pread(header.arch_offset, header.arch_length)
        lineage = v._pread(header.lineage_offset, header.lineage_length)
    g = torch.Generator().manual_seed(1)
    writer = VaultWriter(model / "experts.vault", header, keys, resume=True)
    scale_dtype = SCALE_TORCH_DTYPES[layout.scale_dtype]
    for i in range(len(keys)):
        planes = {}
        for proj in PROJECTIONS:
            c, s = layout.plane(proj, "codes"), layout.plane(proj, "scales")
            planes[proj] = (torch.randint(0, 256, c.shape, generator=g, dtype=torch.uint8),
                            (torch.rand(s.shape, generator=g) * 0.004 + 0.002).to(scale_dtype))
        writer.write_record(i, pack_record(layout, planes))
    writer.finish(arch, lineage)


def disk_gbps(model: Path) -> float:
    """GB/s reading every record of the vault once through the engine's ring (Direct I/O, the queue kept
    full, page cache dropped first): the rate the replay's reads could reach at best."""
    from mosaic_runtime.vault import open_vault

    drop_caches()
    return stream_all(open_vault(model), "direct", seed=0)


# -------------------------------------------------------------------------------------------- replaying
def replayed(trace: Trace, tokens: int) -> list[tuple[list[int], np.ndarray]]:
    """The sequences replayed, in trace order, shorter than MAX_SEQ, until `tokens` tokens: (token ids in
    the replay model's vocabulary, routes [T, L, k])."""
    out, n = [], 0
    for i, routes in enumerate(trace.sequences):
        if routes.shape[0] > MAX_SEQ:
            continue
        if trace.tokens:
            ids = [t % VOCAB for t in trace.tokens[i]]
        else:  # a trace without its text: ids the ring's token statistics cannot have seen before
            ids = np.random.default_rng(i).integers(0, VOCAB, routes.shape[0]).tolist()
        take = min(routes.shape[0], tokens - n)
        out.append((ids[:take], routes[:take]))
        n += take
        if n >= tokens:
            break
    return out


def worker(spec: dict) -> dict:
    """One run, in its own process: open, replay, count."""
    from mosaic_runtime.engine import Engine

    trace = load(spec["trace"], Path(spec["routing"]))
    sequences = replayed(trace, spec["tokens"])
    engine = Engine.open(spec["model"], ram_budget=spec["ram_budget"], io="direct", max_seq=MAX_SEQ,
                         threads=spec["threads"])
    experts, ring = engine.model.experts, engine.store.ring
    current: list[np.ndarray] = []
    experts.replay_routing = lambda layer: current[0][layer]
    if spec["guess_precision"] is not None:
        engine.model.native.lookahead = ReplayLookahead(current, int(engine.arch["num_experts"]),
                                                        spec["guess_precision"])
    total = sum(len(ids) for ids, _ in sequences)
    probe_at = {round(total * (i + 0.5) / spec["probes"]) for i in range(spec["probes"])}
    probes, paused, probing = [], 0.0, probe_ring(engine.vault, "direct")
    sample = max(2 * probing.n_slots, PROBE_BYTES // engine.vault.header.record_bytes)  # two queues at least
    digest = hashlib.sha256()
    n = 0
    busy0 = ring.busy_seconds
    t = time.perf_counter()
    with engine._held():
        for ids, routes in sequences:
            for pos, token in enumerate(ids):
                if n in probe_at:
                    paused += probe_disk(engine, probing, sample, probes, seed=n)
                current[:] = [routes[pos]]
                logits = engine._forward([token], pos)
                digest.update(logits.numpy().tobytes())
                n += 1
    elapsed = time.perf_counter() - t - paused
    busy = ring.busy_seconds - busy0
    c, io = engine.store.policy.counters, engine.store.io
    hits, misses = sum(v.hits for v in c.values()), sum(v.misses for v in c.values())
    out = dict(tokens=n, tok_per_s=n / elapsed, hit_rate=hits / (hits + misses), ring_slots=engine.store.policy.usable,
               bytes_read_per_token=io.bytes_read / n, reads_per_token=io.reads / n,
               ahead_per_token=io.ahead_reads / n, ahead_used=io.ahead_used / max(1, io.ahead_reads),
               read_gbps=io.bytes_read / elapsed / 1e9, io_mode=engine.store.ring.mode, io_wait_s=io.io_s,
               kernel_s=experts.kernel_s, logits_sha256=digest.hexdigest()[:16],
               disk_busy_share=busy / elapsed, busy_gbps=io.bytes_read / max(busy, 1e-9) / 1e9,
               disk_in_run_gbps=probes)
    probing.close()
    engine.close()
    return out


class ReplayLookahead:
    """What stands in for the router lookahead (models/lookahead.py, `Engine.open(router_lookahead=True)`)
    in a replay with --guess-precision p. The trace routes, not the model's router, so the model's own
    guesses would name experts of routing that never happens; this one names each of the next layer's
    recorded experts with probability p and a random other expert otherwise: what a lookahead right that
    often buys at this geometry (a real router's misses are near misses, often used soon after; these are
    random)."""

    def __init__(self, current: list[np.ndarray], n_experts: int, precision: float):
        self.current, self.n_experts, self.precision = current, n_experts, precision
        self.rng = np.random.default_rng(0)

    def guess(self, layer: int, h) -> list[int] | None:
        routes = self.current[0]
        if layer + 1 >= routes.shape[0]:
            return None
        true = routes[layer + 1]
        others = self.rng.permutation(np.setdiff1d(np.arange(self.n_experts), true))
        return [int(e) if self.rng.random() < self.precision else int(others[i]) for i, e in enumerate(true)]


def probe_disk(engine, probing, sample: int, probes: list[float], seed: int) -> float:
    """Pause the decode for a short full-queue read of `sample` random records (stream_all) and append its
    GB/s to `probes`. Returns the seconds to leave out of the decode's time:
    the pause less the time the engine's own reads were in progress during it (reads ahead that landed
    during the pause count as if they had not). `probing`: the probe_ring, made before the run."""
    ring = engine.store.ring
    busy, t = ring.busy_seconds, time.perf_counter()
    probes.append(stream_all(engine.vault, "direct", seed=seed, sample=sample, ring=probing))
    return time.perf_counter() - t - (ring.busy_seconds - busy)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", required=True, help=f"a trace's name ({', '.join(sorted(GEOMETRIES))}) "
                    "or its directory")
    ap.add_argument("--limit-fraction", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                    help="the ring's share of the vault (the cgroup limit is that plus ENGINE_HEADROOM)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens replayed per run (whole sequences, in order)")
    ap.add_argument("--routing", type=Path, default=ROOT.parent / "shared" / "routing")
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data" / "replay")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probes", type=int, default=10, help="disk probes spread through each run (the floor "
                    "takes their median)")
    ap.add_argument("--guess-precision", type=float, help="read ahead with a synthetic router lookahead that "
                    "names each of the next layer's recorded experts with this probability (default: none, the "
                    "ring policy's statistics alone)")
    ap.add_argument("--json", action="store_true", help="only the JSON lines")
    ap.add_argument("--plot", type=Path, help="a PNG of tok/s and hit rate against the ring's share")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if Path(args.trace).is_dir():  # the trace's own directory: its name says which
        args.routing, args.trace = Path(args.trace).resolve().parent, Path(args.trace).resolve().name
    if args.trace not in GEOMETRIES:
        ap.error(f"--trace: no replay geometry for {args.trace!r}; known: {', '.join(sorted(GEOMETRIES))}")
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # said now, not after the runs
        ap.error("--plot needs matplotlib: pip install -e '.[bench]'")
    model = build_vault(args.trace, args.work.resolve())
    vault_bytes = (model / "experts.vault").stat().st_size
    trace = load(args.trace, args.routing)
    steps = np.concatenate([routes for _, routes in replayed(trace, args.tokens)])
    bound_trace = Trace(trace.name, trace.kind, trace.n_experts, trace.top_k, [steps])
    runs = []
    for fraction in args.limit_fraction:
        before = disk_gbps(model)
        drop_caches()
        budget = int(fraction * vault_bytes)
        spec = dict(trace=args.trace, routing=str(args.routing), model=str(model), tokens=args.tokens,
                    ram_budget=budget, threads=args.threads, probes=args.probes, guess_precision=args.guess_precision)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trace", args.trace, "--worker", json.dumps(spec)]
        out = run_worker(cmd, budget + ENGINE_HEADROOM, timeout=3600)
        # the disk's speed drifts within minutes: the floor takes the median of the probes made during the
        # run, which meet the disk the engine met
        gbps = float(np.median(out["disk_in_run_gbps"]))
        out.update(trace=args.trace, limit_fraction=fraction, limit_bytes=budget + ENGINE_HEADROOM,
                   guess_precision=args.guess_precision,
                   disk_probes_gbps=[before, disk_gbps(model)], disk_gbps=gbps,
                   io_floor_tok_per_s=gbps * 1e9 / max(1.0, out["bytes_read_per_token"]),
                   belady_hit_rate=belady_hit_rate(bound_trace, out["ring_slots"]))
        out["vs_io_floor"] = out["io_floor_tok_per_s"] / out["tok_per_s"]
        runs.append(out)
        print(json.dumps(out), flush=True)
    same = len({r["logits_sha256"] for r in runs}) == 1
    if not args.json:
        print(f"logits identical at every budget: {same}")
    if args.plot:
        plot(runs, args.plot, same)


def plot(runs: list[dict], path: Path, same: bool) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=110)
    x = [r["limit_fraction"] for r in runs]
    a.plot(x, [r["tok_per_s"] for r in runs], marker="o", label="Mosaic decode")
    a.plot(x, [r["io_floor_tok_per_s"] for r in runs], linestyle="--", label="I/O floor (bytes read / disk speed)")
    a.set_xlabel("ring (share of the vault)")
    a.set_ylabel("tok/s")
    a.legend(fontsize=7)
    b.plot(x, [r["hit_rate"] for r in runs], marker="o", label="hit rate")
    b.plot(x, [r["belady_hit_rate"] for r in runs], linestyle="--", label="Belady bound (demand reads)")
    b.set_ylim(0, 1.02)
    b.set_xlabel("ring (share of the vault)")
    b.legend(fontsize=7)
    fig.suptitle(f"{runs[0]['trace']} routing replayed; logits identical at every budget: {same}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
