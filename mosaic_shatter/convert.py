"""Convert a checkpoint into a model directory (vault + backbone + tokenizer files), atomically.

Everything is written into a hidden sibling directory `.NAME.partial-PID`, which is renamed to NAME
only when every file is complete and synced; an interrupted convert leaves at most that partial
directory, whose vault has no magic and which no reader opens.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import os
import re
import shutil
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mosaic_runtime.vault.format import (BACKBONE_FILE, FP8_BLOCK, Q4_BLOCK, QUANT_NAMES, VAULT_FILE, QuantType,
                                         encode_meta, plan_header)

from . import __version__
from .checkpoint import Checkpoint, CheckpointError
from .encode import encode_expert
from .plan import Plan, make_plan
from .write_backbone import write_backbone
from .write_vault import DiskFull, VaultWriter

DISK_MARGIN = 64 << 20  # kept free beyond the outputs' own size
_HEX64 = re.compile(r"[0-9a-f]{64}")
_PENDING_HASH = "0" * 64  # same length as a real digest, so the lineage block's size is known up front


class ConvertError(Exception):
    """A convert that cannot start or could not finish; nothing was left at the output path."""


@dataclass
class ConvertResult:
    out: Path
    vault_bytes: int
    backbone_bytes: int
    records: int
    seconds: float


def _sha256(path: Path) -> str:
    """The file's SHA-256; free for Hub-cache files, whose blob is named by it."""
    blob = Path(os.path.realpath(path)).name
    if _HEX64.fullmatch(blob):
        return blob
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _quant_params(plan: Plan, quant: QuantType) -> dict:
    if quant is QuantType.Q4_G32:
        return {"scheme": "Q4_G32", "block": Q4_BLOCK, "scale_dtype": "f16", "symmetric": True,
                "encoder": "q4_0 scale, least-squares refit, keep the better per block"}
    return {"scheme": "FP8_B128", "format": "e4m3fn", "block": [FP8_BLOCK, FP8_BLOCK],
            "scale_dtype": plan.scale_dtype(quant).name.lower(), "passthrough": plan.fp8_passthrough()}


def lineage_block(ckpt: Checkpoint, plan: Plan, quant: QuantType, hashes: dict[str, str], created: str,
                  backbone: dict) -> dict:
    files = [*ckpt.files, ckpt.directory / "config.json", *ckpt.tokenizer_files()]
    return {
        "source": {"path": str(ckpt.directory.resolve()), "repo_id": ckpt.repo_id, "revision": ckpt.revision},
        "files": [{"name": f.name, "bytes": f.stat().st_size, "sha256": hashes.get(f.name, _PENDING_HASH)}
                  for f in files],
        "source_format": {k: v for k, v in plan.source_format.items() if k != "expert_bytes_per_weight"},
        "converter": {"name": "mosaic-shatter", "version": __version__},
        "quant": _quant_params(plan, quant),
        "backbone": backbone,
        "created": created,
    }


def needed_disk_bytes(ckpt: Checkpoint, plan: Plan, quant: QuantType) -> int:
    extra = sum(f.stat().st_size for f in ckpt.tokenizer_files()) + (ckpt.directory / "config.json").stat().st_size
    return plan.vault_bytes(quant) + plan.backbone_bytes + extra + DISK_MARGIN


def _clean_stale_partials(out: Path) -> None:
    """Remove partial directories of earlier converts to the same output whose process is gone."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            os.kill(int(p.name.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError):
            pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(source: str, out: str | os.PathLike, quant: str, *, revision: str | None = None,
            workers: int = 2, force: bool = False, progress: bool = True, keep: frozenset[str] = frozenset()
            ) -> ConvertResult:
    """Convert `source` (checkpoint directory or cached repo id) into the model directory `out`.

    keep: optional parts ("mtp", "vision") to keep in the backbone; text-only by default.

    Raises:
        CheckpointError, UnsupportedModel: the source cannot be read or has no converter.
        ConvertError: the plan has problems, the output exists, or the disk is too small.
    """
    start = time.monotonic()
    qtype = QUANT_NAMES[quant]
    ckpt = Checkpoint(source, revision)
    plan = make_plan(ckpt, keep)
    if plan.problems:
        raise ConvertError("cannot convert:\n  " + "\n  ".join(plan.problems))
    out = Path(out).absolute()
    if out.exists() and not force:
        raise ConvertError(f"{out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(out)
    need, free = needed_disk_bytes(ckpt, plan, qtype), shutil.disk_usage(out.parent).free
    if need > free:
        raise ConvertError(f"not enough disk: the output needs {need / 2**30:.2f} GiB, "
                           f"{out.parent} has {free / 2**30:.2f} GiB free")

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    tmp.mkdir()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers are the parallelism; one intra-op thread each
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="mosaic-convert")
    hash_pool = ThreadPoolExecutor(1, thread_name_prefix="mosaic-hash")
    # SIGTERM unwinds like Ctrl-C, so the partial directory is removed in both cases.
    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if on_main else None
    try:
        hash_files = [*ckpt.files, ckpt.directory / "config.json", *ckpt.tokenizer_files()]
        hash_futures = {f.name: hash_pool.submit(_sha256, f) for f in hash_files}
        for f in [ckpt.directory / "config.json", *ckpt.tokenizer_files()]:
            shutil.copy2(f, tmp / f.name)

        keys = list(plan.experts)
        expert_source_bytes = 3 * plan.hidden * plan.intermediate * plan.source_format["expert_bytes_per_weight"]
        total = sum(t.source.nbytes for t in plan.backbone) + len(keys) * expert_source_bytes
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
        backbone_bytes, backbone_sha = write_backbone(ckpt, plan.backbone, tmp / BACKBONE_FILE,
                                                      {"format": "pt", "mosaic": "backbone"}, progress=bar.update)
        backbone = {"file": BACKBONE_FILE, "bytes": backbone_bytes, "sha256": backbone_sha}

        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        arch = encode_meta(plan.arch)
        pending = encode_meta(lineage_block(ckpt, plan, qtype, {}, created, backbone))
        header = plan_header(qtype, plan.scale_dtype(qtype), plan.arch["num_hidden_layers"],
                             plan.arch["num_experts"], plan.hidden, plan.intermediate, len(keys), len(arch),
                             len(pending))
        writer = VaultWriter(tmp / VAULT_FILE, header, keys)
        try:
            passthrough = qtype is QuantType.FP8_B128 and plan.fp8_passthrough()
            layout = header.layout
            window: deque[tuple[int, Future]] = deque()
            for i, key in enumerate(keys):
                window.append((i, pool.submit(encode_expert, ckpt, plan.experts[key], layout, passthrough)))
                if len(window) >= 2 * workers:  # bounded: at most 2 experts per worker in flight
                    j, fut = window.popleft()
                    writer.write_record(j, fut.result())
                    bar.update(expert_source_bytes)
            while window:
                j, fut = window.popleft()
                writer.write_record(j, fut.result())
                bar.update(expert_source_bytes)
            hashes = {name: fut.result() for name, fut in hash_futures.items()}
            writer.finish(arch, encode_meta(lineage_block(ckpt, plan, qtype, hashes, created, backbone)))
        except BaseException:
            writer.abort()
            raise
        bar.close()
        _fsync_dir(tmp)
        if out.exists():  # --force: swap in the new directory, then drop the old one
            trash = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
        return ConvertResult(out, header.file_size, backbone_bytes, len(keys), time.monotonic() - start)
    except DiskFull as e:
        raise ConvertError(f"disk full: {e}") from None
    except OSError as e:  # the disk filled where space could not be reserved, or a read or write failed
        what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "I/O error"
        raise ConvertError(f"{what}: {e.strerror} ({e.filename or tmp})") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        hash_pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(torch_threads)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["convert", "ConvertError", "ConvertResult", "CheckpointError"]
