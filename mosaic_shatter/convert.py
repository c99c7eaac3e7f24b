"""Convert a checkpoint into a model directory (vault + backbone + tokenizer files), atomically, resumably.

Everything is written into a hidden sibling directory `.NAME.partial` (partial.py), which is renamed to
NAME only when every file is complete and synced. An interrupted, killed or failed convert leaves only
that directory, whose vault has no magic and which no reader opens; the same convert run again resumes
from it.
"""

from __future__ import annotations

import contextlib
import errno
import os
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

from mosaic_runtime.limits import memory_limit
from mosaic_runtime.vault.format import (BACKBONE_FILE, FP8_BLOCK, MXFP4_BLOCK, Q4_BLOCK, QUANT_NAMES, VAULT_FILE,
                                         QuantType, encode_meta, plan_header)

from . import __version__
from .checkpoint import Checkpoint, CheckpointError
from .encode import encode_expert, will_need
from .plan import Plan, make_plan
from .precision import MixedPrecision
from .source_hash import source_sha256
from .write_backbone import write_backbone
from .partial import PartialBusy, PartialDir
from .write_vault import DiskFull, VaultWriter

DISK_MARGIN = 64 << 20  # kept free beyond the outputs' own size
JOURNAL_EVERY = 32  # records between syncs of the vault and its journal: what a kill may cost a resume
_PENDING_HASH = "0" * 64  # same length as a real digest, so the lineage block's size is known up front


class ConvertError(Exception):
    """A convert that cannot start or could not finish; nothing was left at the output path (the work
    done so far stays in the hidden partial directory, for the same convert to resume)."""


class ConvertInterrupted(ConvertError):
    """Ctrl-C or SIGTERM; the work so far is kept for the same convert to resume."""


@dataclass
class ConvertResult:
    out: Path
    vault_bytes: int
    backbone_bytes: int
    records: int
    seconds: float
    resumed_records: int = 0  # records an interrupted run of the same convert had already written


def _quant_params(plan: Plan, quant: QuantType) -> dict:
    if quant is QuantType.Q4_G32:
        if plan.passthrough(quant):
            return {"scheme": "Q4_G32", "block": Q4_BLOCK, "scale_dtype": "f16", "symmetric": True,
                    "encoder": "int4 codes copied from the source, scales converted to f16", "passthrough": True}
        return {"scheme": "Q4_G32", "block": Q4_BLOCK, "scale_dtype": "f16", "symmetric": True,
                "encoder": "q4_0 scale, least-squares refit, keep the better per block"}
    if quant is QuantType.MXFP4_G32:
        return {"scheme": "MXFP4_G32", "format": "e2m1", "block": MXFP4_BLOCK, "scale_dtype": "e8m0",
                "passthrough": plan.passthrough(quant), "expert_bias": plan.expert_bias,
                "encoder": "codes and scales copied from the source" if plan.passthrough(quant) else
                "OCP shared exponent or one above, whichever errs less per block; E2M1 round to nearest even"}
    return {"scheme": "FP8_B128", "format": "e4m3fn", "block": [FP8_BLOCK, FP8_BLOCK],
            "scale_dtype": plan.scale_dtype(quant).name.lower(), "passthrough": plan.fp8_passthrough()}


def lineage_block(ckpt: Checkpoint, plan: Plan, quant: QuantType, hashes: dict[str, str], created: str,
                  backbone: dict, per_record: dict | None = None) -> dict:
    files = [*ckpt.files, ckpt.directory / "config.json", *ckpt.tokenizer_files()]
    return {
        "source": {"path": str(ckpt.directory.resolve()), "repo_id": ckpt.repo_id, "revision": ckpt.revision},
        "files": [{"name": f.name, "bytes": f.stat().st_size, "sha256": hashes.get(f.name, _PENDING_HASH)}
                  for f in files],
        "source_format": {k: v for k, v in plan.source_format.items() if k != "expert_bytes_per_weight"},
        "converter": {"name": "mosaic-shatter", "version": __version__},
        "quant": _quant_params(plan, quant) | ({"per_record": per_record} if per_record else {}),
        "backbone": backbone,
        "created": created,
    }


def needed_disk_bytes(ckpt: Checkpoint, plan: Plan, quant: QuantType) -> int:
    extra = sum(f.stat().st_size for f in ckpt.tokenizer_files()) + (ckpt.directory / "config.json").stat().st_size
    return plan.vault_bytes(quant) + plan.backbone_bytes + extra + DISK_MARGIN


def _clean_stale_partials(out: Path) -> None:
    """Remove the per-process partial directories (`.NAME.partial-PID`) that earlier versions left."""
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


# A worker reads an expert's source, then encodes it: with two a core, one encodes while the other waits
# on the disk (a cold q4 convert on two cores 2.5-2.7 s with four workers against 3.0 with two).
WORKERS_PER_CORE = 2


def default_workers(plan: Plan) -> int:
    """Encoding threads when none are asked for: WORKERS_PER_CORE a core (os.cpu_count, as the engine counts
    its threads), as many as half the memory the process may still take holds (the other half is the page
    cache that carries the source's reads)."""
    return plan.workers_for(memory_limit().available // 2, WORKERS_PER_CORE * (os.cpu_count() or 1))


def convert(source: str, out: str | os.PathLike, quant: str, *, revision: str | None = None,
            workers: int | None = None, force: bool = False, progress: bool = True, keep: frozenset[str] = frozenset(),
            mixed: MixedPrecision | None = None) -> ConvertResult:
    """Convert `source` (checkpoint directory or cached repo id) into the model directory `out`.

    workers: expert encoding threads (default: default_workers).
    keep: optional parts ("mtp", "vision") to keep in the backbone; text-only by default.
    mixed: experts at their own precision (a Q4 vault only): the cold tail of the routing low-bit.

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
    if workers is None:
        workers = default_workers(plan)
    record_quants = per_record = None
    if mixed is not None:
        if qtype is not QuantType.Q4_G32 or plan.expert_bias:
            raise ConvertError("experts at their own precision need --quant q4 and experts without biases")
        try:
            record_quants = mixed.record_quants(list(plan.experts), plan.arch["num_experts"])
        except ValueError as e:
            raise ConvertError(str(e)) from None
        per_record = mixed.lineage(record_quants)
    out = Path(out).absolute()
    if out.exists() and not force:
        raise ConvertError(f"{out} exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_partials(out)
    # What an earlier, interrupted run of this convert holds is space this one reuses.
    held = sum(f.stat().st_size for f in (out.parent / f".{out.name}.partial").glob("*") if f.is_file())
    need, free = needed_disk_bytes(ckpt, plan, qtype), shutil.disk_usage(out.parent).free + held
    if need > free:
        raise ConvertError(f"not enough disk: the output needs {need / 2**30:.2f} GiB, "
                           f"{out.parent} has {free / 2**30:.2f} GiB free")

    try:
        partial = PartialDir(out, _identity(ckpt, qtype, keep, per_record))
    except PartialBusy as e:
        raise ConvertError(str(e)) from None
    tmp = partial.path
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers are the parallelism; one intra-op thread each
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="mosaic-convert")
    hash_pool = ThreadPoolExecutor(1, thread_name_prefix="mosaic-hash")
    # SIGTERM unwinds like Ctrl-C: the work so far is kept for the next run in both cases.
    on_main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if on_main else None
    kept = 0
    try:
        hash_files = [*ckpt.files, ckpt.directory / "config.json", *ckpt.tokenizer_files()]
        hash_futures = {f.name: hash_pool.submit(source_sha256, f) for f in hash_files}
        for f in [ckpt.directory / "config.json", *ckpt.tokenizer_files()]:
            shutil.copy2(f, tmp / f.name)

        keys = list(plan.experts)
        expert_source_bytes = 3 * plan.hidden * plan.intermediate * plan.source_format["expert_bytes_per_weight"]
        backbone_source = sum(t.source.nbytes for t in plan.backbone)
        bar = tqdm(total=backbone_source + len(keys) * expert_source_bytes, unit="B", unit_scale=True,
                   desc="convert", disable=not progress)
        backbone = partial.backbone
        if backbone is None or not (tmp / BACKBONE_FILE).is_file():
            backbone_bytes, backbone_sha = write_backbone(ckpt, plan.backbone, tmp / BACKBONE_FILE,
                                                          {"format": "pt", "mosaic": "backbone"}, progress=bar.update)
            backbone = {"file": BACKBONE_FILE, "bytes": backbone_bytes, "sha256": backbone_sha}
            partial.set_backbone(backbone)
        else:
            bar.update(backbone_source)

        arch = encode_meta(plan.arch)
        pending = encode_meta(lineage_block(ckpt, plan, qtype, {}, partial.created, backbone, per_record))
        header = plan_header(qtype, plan.scale_dtype(qtype), plan.arch["num_hidden_layers"],
                             plan.arch["num_experts"], plan.hidden, plan.intermediate, len(keys), len(arch),
                             len(pending), plan.expert_bias, record_quants)
        writer = VaultWriter(tmp / VAULT_FILE, header, keys, resume=partial.resumed, record_quants=record_quants)
        unjournaled: list[tuple[int, int]] = []  # written, not yet made durable and journaled
        try:
            if writer.resumed:
                kept = writer.recover(partial.written())
            else:
                partial.restart_journal()
            todo = [i for i, crc in enumerate(writer.crcs) if crc is None]
            bar.update(expert_source_bytes * (len(keys) - len(todo)))
            passthrough = plan.passthrough(qtype)
            layouts = [header.stored_layout(q) for q in record_quants] if record_quants else [header.layout] * len(keys)
            window: deque[tuple[int, Future]] = deque()

            def write(j: int, fut: Future) -> None:
                try:
                    record = fut.result()
                except ValueError as e:  # weights no vault can hold (inf or nan, an E8M0 scale of NaN)
                    layer, expert = keys[j]
                    raise ConvertError(f"layer {layer} expert {expert}: {e}") from None
                writer.write_record(j, record)
                bar.update(expert_source_bytes)
                unjournaled.append((j, writer.crcs[j]))
                if len(unjournaled) >= JOURNAL_EVERY:
                    writer.sync()  # the records' bytes are durable before the journal says they are written
                    partial.journal(unjournaled)
                    unjournaled.clear()

            for i in todo:
                # Its bytes start coming in now, while the workers encode the experts ahead of it: a worker
                # reading for itself left the disk idle whenever every worker was computing.
                will_need(ckpt, plan.experts[keys[i]])
                # a low-bit record is always re-quantised: no source holds its codes
                window.append((i, pool.submit(encode_expert, ckpt, plan.experts[keys[i]], layouts[i],
                                              passthrough and layouts[i].quant is qtype)))
                if len(window) >= 2 * workers:  # bounded: at most 2 experts per worker in flight
                    write(*window.popleft())
            while window:
                write(*window.popleft())
            hashes = {name: fut.result() for name, fut in hash_futures.items()}
            writer.finish(arch, encode_meta(lineage_block(ckpt, plan, qtype, hashes, partial.created, backbone,
                                                          per_record)))
        except BaseException:
            with contextlib.suppress(OSError):  # keep what was written since the last journal entry too
                writer.sync()
                partial.journal(unjournaled)
            writer.abort()
            raise
        bar.close()
        partial.finish()
        _fsync_dir(tmp)
        if out.exists():  # --force: swap in the new directory, then drop the old one
            trash = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
        _fsync_dir(out.parent)
        return ConvertResult(out, header.file_size, backbone["bytes"], len(keys), time.monotonic() - start, kept)
    except KeyboardInterrupt:
        raise ConvertInterrupted(f"interrupted; the work so far is kept in {tmp}: run the same command again to "
                                 "resume, or delete that directory") from None
    except DiskFull as e:
        raise ConvertError(f"disk full: {e}{_kept(tmp)}") from None
    except OSError as e:  # the disk filled where space could not be reserved, or a read or write failed
        what = "disk full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "I/O error"
        raise ConvertError(f"{what}: {e.strerror} ({e.filename or tmp}){_kept(tmp)}") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        hash_pool.shutdown(wait=True, cancel_futures=True)
        torch.set_num_threads(torch_threads)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        partial.release()


def _kept(tmp: Path) -> str:
    return f"; the work so far is kept in {tmp}: run the same command again to resume" if tmp.exists() else ""


def _identity(ckpt: Checkpoint, quant: QuantType, keep: frozenset[str], per_record: dict | None) -> dict:
    """What a convert's partial work is made from: a rerun resumes it only if all of this is unchanged."""
    files = [*ckpt.files, ckpt.directory / "config.json", *ckpt.tokenizer_files()]
    return {"source": str(ckpt.directory.resolve()), "quant": quant.name, "keep": sorted(keep),
            "converter": __version__, "per_record": per_record,
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}


__all__ = ["convert", "ConvertError", "ConvertResult", "CheckpointError"]
