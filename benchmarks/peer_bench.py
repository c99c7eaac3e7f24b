"""Mosaic against llama.cpp on the same checkpoint: same threads, each run in a fresh process after the page
cache is dropped, the engines interleaved (A B A B ...) because this VM's bandwidth drifts (FACTS.md §3).

    pip install -e '.[peer]'        # llama-cpp-python: builds llama.cpp from source (~25 min on 2 cores)
    python benchmarks/peer_bench.py [--cases a,b,c,q35,glm] [--rounds 2] [--prompt 128] [--tokens 32]
                                    [--engines NAMES]

Cases (the random-weight models have a real model's per-layer geometry and 8 layers, benchmarks/geometries.py):
  (a) Qwen3-30B-A3B's geometry, in RAM;
  (b) the same under a cgroup v1 memory limit of half the Q4_0 GGUF's size (RAM and page cache together);
  (c) the bundled model, examples/stdlib-moe;
  (q35) Qwen3.5-35B-A3B's geometry (6 Gated DeltaNet and 2 gated-attention layers), in RAM;
  (glm) GLM-4.5-Air's geometry (a dense first layer, 32 of its 128 experts a layer), in RAM;
  (ds3) DeepSeek-V3's geometry (latent attention, a dense first layer, 32 of its 256 experts a layer, 4
        layers), in RAM; llama.cpp runs it as its `deepseek2` architecture;
  (oss) gpt-oss-20b's geometry as released (MXFP4 experts with biases, attention sinks, alternating 128-token
        windows), in RAM: Mosaic from its MXFP4 vault (the checkpoint's codes bit for bit), llama.cpp from
        the MXFP4 GGUF its converter writes (experts MXFP4 as released, the rest bf16), not re-quantised.
The GGUF comes from llama.cpp's own converter (convert_hf_to_gguf.py, in the llama-cpp-python source
distribution, fetched with `pip download` if --llama-src is not given) at bf16, then llama.cpp's quantiser
to Q4_0. The converter refuses tokenizers whose pre-tokenizer it does not know by hash; these checkpoints'
byte-level BPE is declared "qwen2", and GLM's own vocabulary set-up (which wants GLM's special tokens) is
replaced by the plain BPE one. A Qwen3.5 checkpoint without MTP layers is converted with --no-mtp. Both
engines are fed the same token ids, so llama.cpp's tokenizer never runs.

Decode feeds both engines the same fixed tokens rather than each one's own greedy choice: a random-weight
model repeats one token greedily, which would route every step to the same experts and make the memory
limit of case (b) meaningless.

A llama.cpp configuration whose worker dies (its repacked Q4_0 segfaults in prompt processing on AMX CPUs)
gets a row saying so, and the decode ratios are taken against the first configuration that ran.

Printed per run: cold time to first token (process start to first token: load + prefill), prefill tok/s,
decode tok/s, the weight bytes a decoded token must read, and that divided by the same-run bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The environment as the user gave it, for every worker: importing mosaic_runtime here (the bandwidth probe)
# sets OpenMP variables that llama.cpp's OpenMP threads would otherwise inherit (passive waiting slowed its
# decode by a third), and each engine should run with its own defaults.
USER_ENV = dict(os.environ)
if sys.argv[1:3] == ["--worker", "mosaic"]:  # a Mosaic run gets the OpenMP settings its users get (README);
    import mosaic_runtime  # noqa: E402,F401  they only count before torch loads. llama.cpp's runs keep their own.
from benchmarks.convert_bench import drop_caches  # noqa: E402
from benchmarks.geometries import LAYERS, build  # noqa: E402
from benchmarks.memlimit import run_worker  # noqa: E402

DATA = ROOT / "bench-data"
BUNDLED = ROOT / "examples" / "stdlib-moe"
MOSAIC_CONFIGS = {  # name -> Engine.open settings
    "mosaic default": dict(),
    "mosaic exact": dict(precision="exact"),
    "mosaic q4 backbone": dict(backbone="q4"),
}
MOSAIC_NAMED_ONLY = {  # run only when --engines names them
    "mosaic bf16 kv": dict(kv_dtype="bfloat16"),  # a long prompt attended in bf16
}
GEOMETRY_CASES = {"a": "qwen3-30b-a3b", "b": "qwen3-30b-a3b", "q35": "qwen3.5-35b-a3b", "glm": "glm-4.5-air",
                  "ds3": "deepseek-v3", "oss": "gpt-oss-20b"}
MXFP4_CASES = {"oss"}  # released in MXFP4: both engines run the release's expert bytes
LLAMA_CONFIGS = {"llama.cpp Q4_0": True, "llama.cpp Q4_0 no-repack": False}  # name -> weight repacking
LLAMA_MXFP4_CONFIGS = {"llama.cpp MXFP4": True, "llama.cpp MXFP4 no-repack": False}
ENGINE_BYTES = 850 << 20  # case (b): what Mosaic needs besides its ring (backbone, torch, KV cache)


# ---------------------------------------------------------------------------------------------- workers

def mosaic_worker(model: str, prompt: list[int], decode: list[int], threads: int, ram_budget: int | None,
                  **settings) -> dict:
    t0 = time.perf_counter()
    from mosaic_runtime.engine import Engine
    engine = Engine.open(model, ram_budget=ram_budget, threads=threads, max_seq=len(prompt) + len(decode) + 8,
                         **settings)
    # In RAM (the ring holds the vault): every record is read before the prompt, counted in the cold TTFT,
    # as llama.cpp's prefill faults in its mapped weights. Under a memory limit this does nothing.
    engine.finish_preload()
    load_s = time.perf_counter() - t0
    first = next(engine.generate_ids(prompt, max_new_tokens=1, stop_ids=()))
    ttft = engine.stats.ttft_s
    t = time.perf_counter()
    pos = len(prompt)
    for token in decode:  # fed, not sampled: see the module docstring
        engine._forward([token], pos)
        pos += 1
    decode_s = time.perf_counter() - t
    engine._sync_stats()
    s = engine.stats
    kv = engine.model.state.kv
    return {"load_s": load_s, "cold_ttft_s": load_s + ttft, "prefill_tok_s": len(prompt) / ttft,
            "decode_tok_s": len(decode) / decode_s, "token_bytes": mosaic_token_bytes(engine),
            "hit_rate": s.hit_rate, "read_per_token": s.bytes_read / pos, "first": first,
            "kv_bytes_per_token": kv.page_bytes / kv.page_tokens if kv is not None else 0}


def mosaic_token_bytes(engine) -> int:
    """Weight bytes one decoded token reads: every backbone matrix but the embedding (a lookup), and the
    top-k experts' records of each MoE layer."""
    import torch

    def nbytes(w) -> int:
        if isinstance(w, (list, tuple)):
            return sum(nbytes(x) for x in w)
        if dataclasses.is_dataclass(w) and not hasattr(w, "codes"):
            return sum(nbytes(getattr(w, f.name)) for f in dataclasses.fields(w))
        if hasattr(w, "codes"):  # a matrix quantised at load
            return w.codes.nbytes + w.scales.nbytes
        return w.nbytes if isinstance(w, torch.Tensor) and w.dim() == 2 else 0
    weights = engine.model.weights
    total = nbytes(weights.lm_head) + nbytes(weights.layers)
    moe = len(engine.vault.moe_layers)
    return total + moe * engine.arch["num_experts_per_tok"] * engine.vault.layout.payload_bytes


def llama_worker(gguf: str, prompt: list[int], decode: list[int], threads: int, repack: bool) -> dict:
    t0 = time.perf_counter()
    import ctypes

    import llama_cpp as L
    import numpy as np
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = repack
    mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
    model = L.llama_model_load_from_file(gguf.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = len(prompt) + len(decode) + 8
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    load_s = time.perf_counter() - t0

    def feed(ids: list[int]) -> int:
        arr = (L.llama_token * len(ids))(*ids)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, -1), ctypes.POINTER(ctypes.c_float)),
                                       shape=(n_vocab,))
        return int(logits.argmax())

    t = time.perf_counter()
    first = feed(prompt)
    ttft = time.perf_counter() - t
    state = L.llama_state_get_size(ctx)
    t = time.perf_counter()
    for token in decode:
        feed([token])
    decode_s = time.perf_counter() - t
    # what its state grew by, a decoded token: the KV cache rows it wrote
    kv_per_token = (L.llama_state_get_size(ctx) - state) / len(decode)
    return {"load_s": load_s, "cold_ttft_s": load_s + ttft, "prefill_tok_s": len(prompt) / ttft,
            "decode_tok_s": len(decode) / decode_s, "first": first, "kv_bytes_per_token": kv_per_token}


def bandwidth(threads: int, reps: int = 5) -> float:
    """Streaming read GB/s of a 1 GiB buffer (the roofline the kernel benchmark uses), median of reps."""
    import numpy as np

    from mosaic_runtime import _native
    buf = np.ones(1 << 30, np.uint8)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        _native.kernels.stream_read(buf, threads)
        rates.append(buf.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


# ---------------------------------------------------------------------------------------------- set-up

def llama_source(given: str | None) -> Path:
    """llama.cpp's tree as vendored in the llama-cpp-python sdist of the installed version."""
    if given:
        return Path(given)
    version = importlib.metadata.version("llama-cpp-python")
    root = DATA / "peer" / f"llama_cpp_python-{version}"
    if not root.exists():
        (DATA / "peer").mkdir(parents=True, exist_ok=True)
        # without --no-build-isolation pip builds cmake from source just to read the sdist's metadata
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--no-build-isolation", "-d", str(DATA / "peer"), f"llama-cpp-python=={version}"], check=True)
        with tarfile.open(DATA / "peer" / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(DATA / "peer", filter="data")
    return root / "vendor" / "llama.cpp"


def convert_worker(src: str, ckpt: str, out: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py at bf16, declaring the tokenizer's pre-tokenizer as qwen2 (and
    GLM's vocabulary as plain BPE); a checkpoint without MTP layers converted with --no-mtp."""
    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    import conversion.base
    import conversion.glm
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    conversion.glm.Glm4MoeModel.set_vocab = conversion.base.TextModel._set_vocab_gpt2
    import convert_hf_to_gguf
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    no_mtp = ["--no-mtp"] if cfg["model_type"] in ("qwen3_5_moe", "glm4_moe") else []
    sys.argv = ["convert_hf_to_gguf.py", ckpt, "--outtype", "bf16", "--outfile", out, *no_mtp]
    convert_hf_to_gguf.main()


def make_gguf(ckpt: Path, name: str, src: Path, mxfp4: bool = False) -> Path:
    """llama.cpp's Q4_0 GGUF of ckpt; with mxfp4, the GGUF its converter writes (MXFP4 experts kept)."""
    q4 = DATA / "peer" / f"{name}.{'MXFP4' if mxfp4 else 'Q4_0'}.gguf"
    if q4.exists():
        return q4
    bf16 = q4 if mxfp4 else q4.with_suffix("").with_suffix(".bf16.gguf")
    if not bf16.exists():
        tmp = bf16.with_suffix(".partial")
        subprocess.run([sys.executable, __file__, "--convert", str(src), str(ckpt), str(tmp)], check=True)
        tmp.rename(bf16)
    if mxfp4:
        return q4
    import llama_cpp as L
    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = os.cpu_count() or 1
    tmp = q4.with_suffix(".partial")
    if L.llama_model_quantize(str(bf16).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")
    tmp.rename(q4)
    bf16.unlink()  # as large as the checkpoint: disks here hold a few of them at most
    return q4


def make_vault(ckpt: Path, name: str, quant: str = "q4") -> Path:
    out = DATA / "peer" / f"{name}-{quant}"
    if not (out / "experts.vault").exists():
        from mosaic_shatter.convert import convert
        convert(str(ckpt), out, quant, progress=False, force=True)
    return out


def random_checkpoint(geometry: str) -> Path:
    """An 8-layer model of that geometry (benchmarks/geometries.py), with the bundled tokenizer beside it
    (llama.cpp's converter needs one; token ids above its 4,096 become padding tokens in the GGUF)."""
    layers = LAYERS.get(geometry, 8)
    ckpt = build(geometry, DATA / f"{geometry}-{layers}l", layers)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (ckpt / f).exists():
            shutil.copy(BUNDLED / f, ckpt / f)
    return ckpt


def token_stream(case: str, n: int) -> list[int]:
    """The ids both engines are fed: the prompt, then the decoded tokens. Case (c): real text the bundled
    model knows (the standard library's own source); (a), (b): a fixed pseudo-random stream over the
    vocabulary, so routing varies from token to token as with real text."""
    if case == "c":
        from tokenizers import Tokenizer
        import json as json_module
        text = Path(json_module.__file__).read_text()
        return Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).encode(text).ids[:n]
    import random
    rng = random.Random(0)
    return [rng.randrange(8192) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a,b,c")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--engines", help="comma-separated configurations to run, as the table names them (default: "
                    "all), e.g. 'mosaic default,llama.cpp Q4_0'")
    ap.add_argument("--llama-src", help="llama.cpp source tree (default: the installed llama-cpp-python's sdist)")
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "JSON"), help=argparse.SUPPRESS)
    ap.add_argument("--convert", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.convert:
        return convert_worker(*args.convert)
    if args.worker:
        kind, spec = args.worker[0], json.loads(args.worker[1])
        print(json.dumps((mosaic_worker if kind == "mosaic" else llama_worker)(**spec)))
        return

    wanted = None if args.engines is None else {name.strip() for name in args.engines.split(",")}
    known = {*MOSAIC_CONFIGS, *MOSAIC_NAMED_ONLY, *LLAMA_CONFIGS, *LLAMA_MXFP4_CONFIGS}
    if wanted is not None and wanted - known:
        ap.error(f"--engines: unknown {', '.join(sorted(wanted - known))}; known: {', '.join(sorted(known))}")

    def chosen(name: str) -> bool:  # named by --engines; with none named, every configuration not named-only
        return (name in wanted) if wanted is not None else (name not in MOSAIC_NAMED_ONLY)

    try:
        importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("peer_bench: llama-cpp-python is not installed (pip install -e '.[peer]', or put a build of it "
                 "on PYTHONPATH): the GGUF and the peer's runs need it")
    src = llama_source(args.llama_src)
    models = {}
    for case in args.cases.split(","):
        if case == "c":
            models["c"] = (make_vault(BUNDLED, "stdlib-moe"), make_gguf(BUNDLED, "stdlib-moe", src))
        else:
            geometry = GEOMETRY_CASES[case]
            ckpt = random_checkpoint(geometry)
            mxfp4 = case in MXFP4_CASES
            models[case] = (make_vault(ckpt, ckpt.name, "mxfp4" if mxfp4 else "q4"),
                            make_gguf(ckpt, ckpt.name, src, mxfp4))
    print(f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}; threads {args.threads}; "
          f"prompt {args.prompt} tokens, {args.tokens} decoded; page cache dropped before each run")
    print("| case | engine | cold TTFT s | prefill tok/s | decode tok/s | decode vs llama.cpp (default) | "
          "weight MB per token | token time / (bytes / bandwidth) | KV KB per token | "
          "Mosaic ring hit rate, MB read per token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        vault, gguf = models[case]
        stream = token_stream(case, args.prompt + args.tokens)
        prompt, decode = stream[:args.prompt], stream[args.prompt:]
        limit = gguf.stat().st_size // 2 if case == "b" else None
        if limit:
            print(f"(b): cgroup limit {limit / 1e9:.2f} GB; Mosaic's ring {(limit - ENGINE_BYTES) / 1e9:.2f} GB")
        runs: dict[str, list[dict]] = {}
        failures: dict[str, list[str]] = {}  # llama.cpp configurations whose worker died (AMX: docstring)
        bws = []
        llama_configs = LLAMA_MXFP4_CONFIGS if case in MXFP4_CASES else LLAMA_CONFIGS
        if limit:  # repacked, it made no progress under the limit
            llama_configs = {name: False for name, repack in llama_configs.items() if not repack}
        for _ in range(args.rounds):
            bws.append(bandwidth(args.threads))
            for name, settings in {**MOSAIC_CONFIGS, **MOSAIC_NAMED_ONLY, **llama_configs}.items():
                if not chosen(name):
                    continue
                base = dict(prompt=prompt, decode=decode, threads=args.threads)
                if name.startswith("mosaic"):
                    spec = dict(base, model=str(vault), ram_budget=limit - ENGINE_BYTES if limit else None, **settings)
                    kind = "mosaic"
                else:
                    spec, kind = dict(base, gguf=str(gguf), repack=settings), "llama"
                drop_caches()
                cmd = [sys.executable, __file__, "--worker", kind, json.dumps(spec)]
                try:
                    runs.setdefault(name, []).append(run_worker(cmd, limit, timeout=900, env=USER_ENV))
                except RuntimeError as e:  # the peer crashing is a result; Mosaic crashing is a bug
                    if kind != "llama":
                        raise
                    failures.setdefault(name, []).append(str(e).split(":")[0])
        bw = statistics.median(bws)
        token_bytes = {name: r[0].get("token_bytes") for name, r in runs.items() if r}
        token_bytes.update({name: gguf_token_bytes(gguf, src) for name in llama_configs if name in runs})
        peer_name = next((name for name in llama_configs if runs.get(name)), None)
        peer = statistics.median(r["decode_tok_s"] for r in runs[peer_name]) if peer_name else float("nan")
        for name, why in failures.items():
            print(f"| ({case}) | {name} | failed: {', '.join(why)} | | | | | | | |", flush=True)
        for name, rs in runs.items():
            if not rs:
                continue
            med = lambda key: statistics.median(r[key] for r in rs)  # noqa: E731
            tb = token_bytes[name]
            roof = med("decode_tok_s") * tb / (bw * 1e9)
            ratio = f"{med('decode_tok_s') / peer:.2f}x" if peer_name else "-"
            print(f"| ({case}) | {name} | {med('cold_ttft_s'):.2f} | {med('prefill_tok_s'):.1f} | "
                  f"{med('decode_tok_s'):.1f} ({min(r['decode_tok_s'] for r in rs):.1f}-"
                  f"{max(r['decode_tok_s'] for r in rs):.1f}) | {ratio} | "
                  f"{tb / 1e6:.0f} | {1 / roof:.2f} | {med('kv_bytes_per_token') / 1e3:.1f} | {ring_column(rs)} |",
                  flush=True)
        against = peer_name or ("nothing (every llama.cpp configuration failed)" if failures else "nothing")
        print(f"(case {case}) same-run streaming bandwidth: {', '.join(f'{b:.1f}' for b in bws)} GB/s; decode "
              f"ratios against {against}")
        if peer_name and len(runs[peer_name]) == args.rounds:
            print_paired(case, runs, peer_name)


def print_paired(case: str, runs: dict[str, list[dict]], peer_name: str) -> None:
    """Each Mosaic configuration's ratios to the peer round by round: the two ran minutes apart in a round,
    so a ratio within a round is steadier than the ratio of medians when the machine's speed drifts."""
    peer = runs[peer_name]
    for name, rs in runs.items():
        if not name.startswith("mosaic") or len(rs) != len(peer):
            continue
        for key, what in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            ratios = [m[key] / p[key] for m, p in zip(rs, peer)]
            print(f"(case {case}) {name} {what} against {peer_name}, round by round: "
                  f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x, "
                  f"lowest {min(ratios):.2f}x)")


def ring_column(runs: list[dict]) -> str:
    if "hit_rate" not in runs[0]:
        return "-"
    return (f"{statistics.median(r['hit_rate'] for r in runs):.2f}, "
            f"{statistics.median(r['read_per_token'] for r in runs) / 1e6:.0f}")


def gguf_token_bytes(path: Path, src: Path) -> int:
    """Weight bytes a decoded token reads in llama.cpp: every tensor but the embedding (unless it is also the
    tied head), experts scaled by top-k / experts (a merged expert tensor holds all of a layer's experts)."""
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    top_k = reader.fields[f"{arch}.expert_used_count"].contents()
    n_exp = reader.fields[f"{arch}.expert_count"].contents()
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        total += t.n_bytes * top_k // n_exp if "_exps" in t.name else t.n_bytes
    return total


if __name__ == "__main__":
    main()
