"""Convert throughput next to this disk's raw read and write speed, measured in the same run, and peak RSS.

    python benchmarks/convert_bench.py [--layers 2] [--data bench-data] [--hub-cache | --local-dir | --git-clone]

Builds (once) a bf16 checkpoint with Qwen3-30B-A3B's per-layer geometry (hidden 2048, 128 experts of
768, vocab 8192) and `--layers` MoE layers, about 1.3 GB a layer, in 1 GiB shards. Then, with the page
cache dropped before each step (needs root; otherwise the figures are warm and say so):
raw O_DIRECT read of the shards, raw O_DIRECT write of as many bytes, and `convert --quant q4|fp8`,
each in a fresh process whose peak RSS is reported beside probe's bound. The I/O floor is what one disk
needs to read the source and write the output (backbone and vault) at those raw rates, one after the
other: a bound for a disk that does one at a time, an estimate for one that overlaps them. `--hub-cache`
converts from a view of the same files laid out as the Hugging Face cache keeps a download (snapshot
symlinks to blobs named by their SHA-256), where convert takes the lineage's hashes from the blob names
instead of hashing the source; `--local-dir` from a view laid out as `hf download --local-dir` leaves one
(the files, and a metadata file for each recording its SHA-256), where convert takes them from that
metadata; `--git-clone` from a git repository with the weights in git-lfs (needs git and git-lfs), where
convert takes them from the pointers.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CHUNK = 4 << 20  # 4 MiB direct reads: FACTS.md §3 puts this disk at 2-3 GiB/s with them
def build_checkpoint(path: Path, layers: int) -> Path:
    """A bf16 checkpoint with Qwen3-30B-A3B's per-layer geometry (benchmarks/geometries.py), built once."""
    from benchmarks.geometries import build
    return build("qwen3-30b-a3b", path, layers)


def hub_cache_view(ckpt: Path) -> Path:
    """The checkpoint as the Hub's cache lays out a download, built once beside it: each file a symlink from
    snapshots/bench/ to blobs/<its SHA-256>, a hard link to the same bytes (no copy)."""
    root = ckpt.parent / f"{ckpt.name}-hub"
    snapshot = root / "snapshots" / "bench"
    if snapshot.is_dir():
        return snapshot
    blobs, partial = root / "blobs", root / "snapshots" / "partial"
    blobs.mkdir(parents=True, exist_ok=True)
    partial.mkdir(parents=True, exist_ok=True)
    from mosaic_shatter.source_hash import source_sha256  # the lineage's hash of a file
    for f in sorted(p for p in ckpt.iterdir() if p.is_file()):
        blob = blobs / source_sha256(f)
        if not blob.exists():
            os.link(f, blob)
        link = partial / f.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, partial))
    partial.rename(snapshot)
    return snapshot


def local_dir_view(ckpt: Path) -> Path:
    """The checkpoint as `hf download --local-dir` leaves it, built once beside it: each file a hard link to
    the same bytes, and .cache/huggingface/download/<name>.metadata with a commit, the file's SHA-256 (its
    ETag) and the time it was recorded."""
    root = ckpt.parent / f"{ckpt.name}-local-dir"
    if root.is_dir():
        return root
    partial = ckpt.parent / f"{ckpt.name}-local-dir.partial"
    metadata = partial / ".cache" / "huggingface" / "download"
    metadata.mkdir(parents=True, exist_ok=True)
    from mosaic_shatter.source_hash import source_sha256  # the lineage's hash of a file
    for f in sorted(p for p in ckpt.iterdir() if p.is_file()):
        link = partial / f.name
        link.unlink(missing_ok=True)
        os.link(f, link)
        (metadata / f"{f.name}.metadata").write_text(f"bench\n{source_sha256(f)}\n{time.time()}\n")
    partial.rename(root)
    return root


def git_clone_view(ckpt: Path) -> Path:
    """The checkpoint as `git clone` with git-lfs leaves it: the files in a work tree, a pointer naming each
    weight file's SHA-256 in the index, the objects in .git/lfs/objects (a copy of the weights: git-lfs keeps
    one). Built once beside it with the real git and git-lfs; the files are hard links to the same bytes.
    Refreshed each time as `git status` would, since a link made to those bytes later changes their ctime."""
    root = ckpt.parent / f"{ckpt.name}-git"

    def git(where: Path, *args: str) -> None:
        subprocess.run(["git", "-C", str(where), *args], check=True, capture_output=True)
    if not root.is_dir():
        partial = ckpt.parent / f"{ckpt.name}-git.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for f in sorted(p for p in ckpt.iterdir() if p.is_file()):
            os.link(f, partial / f.name)
        git(partial, "init", "-q")
        git(partial, "lfs", "install", "--local")
        git(partial, "lfs", "track", "*.safetensors")
        git(partial, "add", ".")
        git(partial, "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "checkpoint")
        partial.rename(root)  # renaming the directory changes no file's stat data: the index still holds
    time.sleep(0.05)  # past the index's timestamp, so that a refresh leaves nothing racily clean
    git(root, "status", "--short")
    from mosaic_shatter.git_lfs import lfs_sha256
    if any(lfs_sha256(f) is None for f in root.glob("*.safetensors")):
        raise SystemExit(f"{root}: git-lfs's pointers do not name the files; delete it to rebuild it")
    return root


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def raw_read(files: list[Path]) -> tuple[int, float]:
    buf = mmap.mmap(-1, CHUNK)  # page aligned, as O_DIRECT wants
    total, t = 0, time.perf_counter()
    for f in files:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            while (n := os.readv(fd, [buf])) > 0:
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t


def raw_write(path: Path, nbytes: int) -> float:
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    t = time.perf_counter()
    try:
        for _ in range(nbytes // CHUNK):
            os.writev(fd, [buf])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes. Not getrusage's ru_maxrss: Linux carries that
    across execve, so a worker started by a large parent (one that just built a checkpoint) reports at
    least the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


CONVERT = f"""
import sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from benchmarks.convert_bench import peak_rss
from mosaic_shatter.convert import convert
t = time.perf_counter()
convert(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, force=True)
print(time.perf_counter() - t, peak_rss())
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data")
    layout = ap.add_mutually_exclusive_group()
    layout.add_argument("--hub-cache", action="store_true", help="convert from the files laid out as the Hub's cache")
    layout.add_argument("--local-dir", action="store_true",
                        help="convert from the files laid out as `hf download --local-dir` leaves them")
    layout.add_argument("--git-clone", action="store_true",
                        help="convert from the files as a `git clone` with git-lfs leaves them (needs git-lfs)")
    args = ap.parse_args()
    ckpt = build_checkpoint(args.data / f"qwen3-30b-geometry-{args.layers}l", args.layers)
    if args.hub_cache:
        ckpt = hub_cache_view(ckpt)
    elif args.local_dir:
        ckpt = local_dir_view(ckpt)
    elif args.git_clone:
        ckpt = git_clone_view(ckpt)
    files = sorted(ckpt.glob("*.safetensors"))
    source_bytes = sum(f.stat().st_size for f in files)

    from mosaic_shatter.checkpoint import Checkpoint
    from mosaic_shatter.convert import default_workers
    from mosaic_shatter.plan import make_plan
    plan = make_plan(Checkpoint(str(ckpt)))
    bound = plan.peak_ram_bytes(default_workers(plan))  # the converts below start that many workers

    cold = drop_caches()
    n, dt = raw_read(files)
    read_gbs = n / dt / 1e9
    write_gbs = source_bytes / raw_write(args.data / "write-test.bin", source_bytes) / 1e9
    layout = ("; laid out as the Hub's cache" if args.hub_cache else
              "; laid out as an `hf download --local-dir`" if args.local_dir else
              "; a git-lfs clone" if args.git_clone else "")
    cache = "dropped" if cold else "WARM"
    print(f"source: {source_bytes / 1e9:.2f} GB in {len(files)} shards{layout}; page cache {cache}")
    print(f"raw O_DIRECT read {read_gbs:.2f} GB/s, raw O_DIRECT write {write_gbs:.2f} GB/s (4 MiB requests)")
    print("| quant | seconds | source GB/s | vs raw read | output GB | I/O floor s, read + write (vs it) | peak RSS "
          "| probe's bound |")
    print("|---|---|---|---|---|---|---|---|")
    for quant in ("q4", "fp8"):
        drop_caches()
        out_dir = args.data / f"out-{quant}"
        out = subprocess.run([sys.executable, "-c", CONVERT, str(ckpt), str(out_dir), quant],
                             capture_output=True, text=True, check=True).stdout.split()
        seconds, rss = float(out[0]), int(out[1])
        gbs = source_bytes / seconds / 1e9
        # The disk's own bound for this convert: the source read and the output written, one after the other
        # (one disk does both), at the raw rates above.
        written = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
        floor = source_bytes / (read_gbs * 1e9) + written / (write_gbs * 1e9)
        print(f"| {quant} | {seconds:.1f} | {gbs:.2f} | {gbs / read_gbs:.2f} | {written / 1e9:.2f} "
              f"| {floor:.2f} ({seconds / floor:.2f}x) | {rss / 2**30:.2f} GiB "
              f"| {bound / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
