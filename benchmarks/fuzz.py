"""Coverage-guided fuzzing (atheris, libFuzzer's engine for Python) of what reads hostile input:

  vault       the vault reader: fixed header, arch and lineage blocks, index (experts.vault); the fuzzer's
              bytes are the file's header and metadata, with both CRC-32s recomputed so that mutations
              reach the parser behind them, then the runtime's recipe from the arch block
  checkpoint  shatter's checkpoint reading: config.json, model.safetensors.index.json and a safetensors
              header, then the conversion plan (what `mosaic-shatter probe` does)
  template    chat templates rendered in the sandbox, with fuzzed messages

    python benchmarks/fuzz.py --target vault --runs 1000000 [--seed 1] [--work bench-data/fuzz]

Each target may raise only its documented errors (VaultError, or NotImplementedError for an arch block
the runtime does not run; CheckpointError, UnsupportedModel; ChatTemplateError); anything else is a
finding, which libFuzzer reports with the input that caused it (crash-* in WORK). Prints one JSON line of
counts per run and exits non-zero on a finding. The seeds are built from the bundled model (its vault
converted once into WORK) and the real configs in tests/data/configs.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench-data" / "fuzz"
TARGETS = ("vault", "checkpoint", "template")


# ---------------------------------------------------------------------------------------------- seeds

def vault_seeds(work: Path) -> list[bytes]:
    """The bundled model's Q4 vault up to its first record (fixed header, arch, lineage, index), and the same
    with experts at their own precision (per-record types and lengths in the index)."""
    from mosaic_shatter.convert import convert
    from mosaic_shatter.precision import ROUTING_FORMAT, MixedPrecision
    seeds = []
    for name in ("stdlib-moe-q4", "stdlib-moe-mixed"):
        out = work / name
        if not (out / "experts.vault").exists():
            mixed = None
            if name.endswith("mixed"):  # counts that keep the first experts of each layer at Q4
                config = json.loads((ROOT / "examples" / "stdlib-moe" / "config.json").read_text())
                experts, layers = config["num_local_experts"], config["num_hidden_layers"]
                routing = work / "routing.json"
                routing.write_text(json.dumps({"format": ROUTING_FORMAT, "tokens": 1, "counts": {
                    str(layer): list(range(experts, 0, -1)) for layer in range(layers)}}))
                mixed = MixedPrecision.of(routing, "q3", 0.8)
            convert(str(ROOT / "examples" / "stdlib-moe"), out, "q4", progress=False, force=True, mixed=mixed)
        raw = (out / "experts.vault").read_bytes()
        (data_offset,) = struct.unpack_from("<Q", raw, 104)
        seeds.append(raw[:data_offset])
    return seeds


def checkpoint_seeds(work: Path) -> list[bytes]:
    configs = sorted((ROOT / "tests" / "data" / "configs").glob("*.json"))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [4, 2], "data_offsets": [0, 16]},
                         "__metadata__": {"format": "pt"}}).encode()
    index = json.dumps({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}).encode()
    return [pack_parts(c.read_bytes(), index, header) for c in configs]


def template_seeds(work: Path) -> list[bytes]:
    bundled = json.loads((ROOT / "examples" / "stdlib-moe" / "tokenizer_config.json").read_text())
    return [pack_parts(bundled["chat_template"].encode(),
                       b'[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]')]


def pack_parts(*parts: bytes) -> bytes:
    """Length-prefixed parts, so a mutation of one part leaves the others whole (unpack_parts)."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def unpack_parts(data: bytes, n: int) -> list[bytes]:
    parts, at = [], 0
    for _ in range(n):
        (size,) = struct.unpack_from("<I", data, at) if at + 4 <= len(data) else (0,)
        at += 4
        parts.append(data[at:at + size])
        at += size
    return parts


# ---------------------------------------------------------------------------------------------- targets

class Vault:
    def __init__(self, tmp: Path):
        self.dir = tmp / "vault"
        self.dir.mkdir()
        (self.dir / "backbone.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")

    def __call__(self, data: bytes) -> None:
        from mosaic_runtime.models import model_recipe
        from mosaic_runtime.vault import VaultError, open_vault
        raw = bytearray(data)
        if len(raw) >= 128:
            arch_offset, data_offset, file_size = (struct.unpack_from("<Q", raw, o)[0] for o in (56, 104, 112))
            if 128 <= arch_offset <= data_offset <= len(raw):
                struct.pack_into("<I", raw, 120, zlib.crc32(raw[arch_offset:data_offset]))
            struct.pack_into("<I", raw, 124, zlib.crc32(raw[:124]))
        path = self.dir / "experts.vault"
        path.write_bytes(raw)
        if len(raw) >= 128 and len(raw) < file_size <= 1 << 24:
            os.truncate(path, file_size)  # the records' pages, as zeros (sparse)
        try:
            with open_vault(self.dir) as vault:
                model_recipe(vault.arch)
                for (layer, expert) in list(vault.entries)[:2]:
                    vault.read_record(layer, expert)
        except (VaultError, NotImplementedError):  # a damaged vault; an arch this runtime does not run
            pass


class Checkpoint:
    def __init__(self, tmp: Path):
        self.dir = tmp / "ckpt"
        self.dir.mkdir()

    def __call__(self, data: bytes) -> None:
        from mosaic_shatter.architectures import UnsupportedModel
        from mosaic_shatter.checkpoint import Checkpoint as Ckpt
        from mosaic_shatter.checkpoint import CheckpointError
        from mosaic_shatter.plan import make_plan
        config, index, header = unpack_parts(data, 3)
        for f in self.dir.iterdir():
            f.unlink()
        (self.dir / "config.json").write_bytes(config)
        if index:
            (self.dir / "model.safetensors.index.json").write_bytes(index)
        (self.dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
        try:
            make_plan(Ckpt(str(self.dir)))
        except (CheckpointError, UnsupportedModel):
            pass


class Template:
    def __init__(self, tmp: Path):
        from mosaic_runtime.generate import TextCodec
        self.codec = TextCodec.__new__(TextCodec)  # no tokenizer: only the template is under test
        self.codec.special = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": None}

    def __call__(self, data: bytes) -> None:
        from mosaic_runtime.generate import ChatTemplateError
        template, messages = unpack_parts(data, 2)
        try:
            msgs = json.loads(messages.decode("utf-8", "replace"))
        except (json.JSONDecodeError, RecursionError):
            msgs = [{"role": "user", "content": messages.decode("utf-8", "replace")}]
        self.codec.chat_template = template.decode("utf-8", "replace")
        try:
            self.codec.render_chat(msgs if isinstance(msgs, list) else [msgs])
        except ChatTemplateError:
            pass


HARNESSES = {"vault": (Vault, vault_seeds), "checkpoint": (Checkpoint, checkpoint_seeds),
             "template": (Template, template_seeds)}


# ---------------------------------------------------------------------------------------------- driver

def fuzz(target: str, runs: int, seed: int, corpus: Path) -> None:
    """In this process: libFuzzer's loop over the target (exits when done or at the first finding)."""
    import importlib
    import inspect

    import atheris
    # Mosaic's own modules and Jinja's, instrumented function by function: the editable install's import
    # hook hides Mosaic's from atheris.instrument_imports, and instrument_all would take torch too.
    for name in ("mosaic_runtime.generate", "mosaic_runtime.recipe", "mosaic_runtime.vault.format",
                 "mosaic_runtime.vault.reader", "mosaic_runtime.models", "mosaic_shatter.architectures",
                 "mosaic_shatter.checkpoint", "mosaic_shatter.plan", "jinja2.lexer", "jinja2.parser",
                 "jinja2.compiler", "jinja2.sandbox", "jinja2.runtime", "jinja2.filters"):
        module = importlib.import_module(name)
        for obj in list(vars(module).values()):
            for fn in [obj, *vars(obj).values()] if inspect.isclass(obj) else [obj]:
                fn = getattr(fn, "__func__", fn)
                if inspect.isfunction(fn) and fn.__module__ == name:
                    atheris.instrument_func(fn)
    make, _ = HARNESSES[target]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        one = make(Path(tmp))
        atheris.Setup([sys.argv[0], f"-runs={runs}", f"-seed={seed}", "-max_len=65536", "-timeout=20",
                       "-rss_limit_mb=4096", "-print_final_stats=1", str(corpus)], one)
        atheris.Fuzz()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", choices=TARGETS, required=True)
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", type=Path, default=WORK, help="seeds, corpora and findings (crash-*) go here")
    ap.add_argument("--corpus", type=Path, help="corpus directory (default: WORK/corpus-TARGET)")
    ap.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.work = args.work.resolve()  # the fuzzer runs in it: relative paths would be read from there
    corpus = (args.corpus or args.work / f"corpus-{args.target}").resolve()
    if args.in_process:
        return fuzz(args.target, args.runs, args.seed, corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(HARNESSES[args.target][1](args.work)):
        (corpus / f"seed-{i}").write_bytes(s)
    t = time.time()
    res = subprocess.run([sys.executable, __file__, "--in-process", "--target", args.target, "--runs",
                          str(args.runs), "--seed", str(args.seed), "--corpus", str(corpus)],
                         capture_output=True, text=True, cwd=args.work)
    log = res.stdout + res.stderr
    done = [int(line.split()[-1]) for line in log.splitlines() if line.startswith("stat::number_of_executed_units")]
    found = [line for line in log.splitlines() if "Uncaught Python exception" in line or "ERROR: libFuzzer" in line]
    print(json.dumps({"target": args.target, "runs_asked": args.runs, "executed": done[0] if done else None,
                      "seconds": round(time.time() - t, 1), "corpus": len(list(corpus.iterdir())),
                      "finding": bool(found) or res.returncode != 0, "returncode": res.returncode}))
    if res.returncode != 0:
        print("\n".join(log.splitlines()[-40:]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
