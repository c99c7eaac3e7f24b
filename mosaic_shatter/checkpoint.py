"""A Hugging Face checkpoint directory (or a repo id in the local Hub cache): config and tensors.

Listing reads only safetensors headers, never weights, so `probe` answers in seconds at any scale.
Tensors are read lazily, one at a time or one contiguous slice at a time, with pread.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .git_lfs import is_lfs_pointer

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "added_tokens.json")


class CheckpointError(Exception):
    """A checkpoint that cannot be read or converted; the message says what and where."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors spelling: BF16, F32, F8_E4M3, ...
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offsets of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def parse_json_object(raw: bytes, where: str) -> dict:
    """JSON that must hold an object (config.json, an index, a safetensors header); anything else is a
    CheckpointError naming `where`."""
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {type(value).__name__}")
    return value


def read_json_object(path: Path) -> dict:
    return parse_json_object(path.read_bytes(), str(path))


def check_not_lfs_pointer(path: Path) -> None:
    """A git-lfs pointer in place of a file (a clone that did not fetch its LFS objects): say so, rather than
    fail to parse it."""
    if is_lfs_pointer(path):
        raise CheckpointError(f"{path}: a git-lfs pointer, not the file itself (the clone did not fetch its LFS "
                              f"objects): run `git lfs pull` in {path.parent}")


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor descriptors of one safetensors file, checked against its size; reads only the header."""
    check_not_lfs_pointer(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {n} exceeds the file or the 100 MiB limit")
        meta = parse_json_object(f.read(n), f"{path} header")
    base, out = 8 + n, {}
    for name, v in meta.items():
        if name == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        dtype, shape = (v.get("dtype"), v.get("shape")) if isinstance(v, dict) else (None, None)
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(_is_count(s) for s in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: {name} is not a tensor entry (dtype, shape, data_offsets)")
        (begin, end), shape = offsets, tuple(shape)
        info = TensorInfo(name, dtype, shape, path, base + begin, base + end)
        if dtype in DTYPE_BYTES and info.nbytes != info.numel * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{path}: {name} has {info.nbytes} bytes for {dtype} {list(shape)}")
        if base + end > size:
            raise CheckpointError(f"{path}: {name} ends at byte {base + end}, file is {size} bytes (truncated?)")
        out[name] = info
    return out


def resolve(source: str, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """A local directory, or a repo id found offline in the Hub cache.

    Returns:
        (directory, repo_id or None, revision or None)
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None, None
    if path.exists():
        raise CheckpointError(f"{source} is a file; give the checkpoint directory")
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise CheckpointError(f"{source}: no such directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        snapshot = snapshot_download(source, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        raise CheckpointError(f"{source} is not in the local Hugging Face cache. Download it first:\n"
                              f"  hf download {source}" + (f" --revision {revision}" if revision else "")) from None
    snapshot = Path(snapshot)
    return snapshot, source, revision or snapshot.name


class Checkpoint:
    """Config, tensor inventory and lazy tensor access of one checkpoint."""

    def __init__(self, source: str, revision: str | None = None):
        self.directory, self.repo_id, self.revision = resolve(source, revision)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.directory}: no config.json (not a Hugging Face checkpoint?)")
        check_not_lfs_pointer(config_path)
        self.config = read_json_object(config_path)
        for f in self.tokenizer_files():  # copied into the output as they are
            check_not_lfs_pointer(f)
        self.files = self._weight_files()
        self.tensors: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, info in read_safetensors_header(f).items():
                if name in self.tensors:
                    raise CheckpointError(f"{name} appears in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = info

    def _weight_files(self) -> list[Path]:
        d = self.directory
        index = d / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map", {})
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map is not an object of tensor names to file names")
            names = sorted(set(weight_map.values()))
            outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
            if outside:  # a shard must be a file in this directory, never a path out of it
                raise CheckpointError(f"{index}: shard {outside[0]!r} is not a file name in {d}")
            missing = [n for n in names if not (d / n).is_file()]
            if missing:
                raise CheckpointError(f"{d}: the index names shards that are missing: {', '.join(missing[:3])}"
                                      + (" ..." if len(missing) > 3 else ""))
            return [d / n for n in names]
        files = sorted(d.glob("*.safetensors"))
        if not files:
            bins = sorted(d.glob("*.bin")) + sorted(d.glob("*.pt")) + sorted(d.glob("*.gguf"))
            hint = f" (found {bins[0].name}: only safetensors checkpoints are supported)" if bins else ""
            raise CheckpointError(f"{d}: no safetensors weights{hint}")
        return files

    @property
    def source_label(self) -> str:
        return self.repo_id if self.repo_id else str(self.directory.resolve())

    def tokenizer_files(self) -> list[Path]:
        return [self.directory / n for n in TOKENIZER_FILES if (self.directory / n).is_file()]

    def _span(self, name: str, index: tuple) -> tuple[TensorInfo, int, list[int], int]:
        """(info, first byte, shape, byte count) of a tensor or of the part of it `index` selects (read())."""
        info = self.tensors[name]
        shape, at = list(info.shape), info.begin
        itemsize = DTYPE_BYTES[info.dtype]
        stride = itemsize
        for s in shape:
            stride *= s
        for i in index:
            stride //= shape[0]
            if isinstance(i, slice):
                start, stop, step = i.indices(shape[0])
                if step != 1 or index[-1] is not i:
                    raise ValueError(f"{name}: only a trailing step-1 slice is supported, got {index}")
                at += start * stride
                shape = [max(0, stop - start), *shape[1:]]
                break
            if not 0 <= i < shape[0]:
                raise IndexError(f"{name}: index {i} out of range for {info.shape}")
            at += i * stride
            shape = shape[1:]
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        return info, at, shape, nbytes

    def will_need(self, name: str, index: tuple = ()) -> None:
        """Ask the kernel to start reading what read(name, index) will read (posix_fadvise WILLNEED): it
        returns at once, and the disk keeps working while every encoder is busy computing."""
        info, at, _, nbytes = self._span(name, index)
        if nbytes == 0 or not hasattr(os, "posix_fadvise"):  # macOS has no fadvise
            return
        fd = os.open(info.file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, at, nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """A tensor, or a contiguous part of it, read with pread into fresh memory.

        Args:
            index: leading-dimension selection, integers optionally followed by one step-1 slice,
                e.g. (3,) for expert 3 of a fused [E, ...] tensor, (3, slice(0, I)) for its first I
                rows, (slice(r0, r1),) for a chunk of rows. Every such selection is one byte range.

        pread rather than mmap: pages of a mapped shard count towards the process's resident set
        until the whole shard is unmapped, so converting through mmap grows with the shard size.
        """
        info, at, shape, nbytes = self._span(name, index)
        buf = torch.empty(nbytes, dtype=torch.uint8)  # not zero-filled: every byte is read into it
        view, done = memoryview(buf.numpy()), 0
        fd = os.open(info.file, os.O_RDONLY)
        try:
            while done < nbytes:  # one preadv moves at most ~2 GiB
                got = os.preadv(fd, [view[done:]], at + done)
                if got <= 0:
                    raise CheckpointError(f"{info.file}: short read of {name} ({done} of {nbytes} bytes at {at})")
                done += got
        finally:
            os.close(fd)
        return buf.view(TORCH_DTYPES[info.dtype]).reshape(shape)
